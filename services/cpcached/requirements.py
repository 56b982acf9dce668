"""Print the project's requirements from pyproject.toml, one a line: the
base dependencies plus the named extras that exist. The image installs them
in a layer of their own, before the code is copied."""

import sys
import tomllib

with open(sys.argv[1], "rb") as fh:
    project = tomllib.load(fh)["project"]
extras = project.get("optional-dependencies", {})
for requirement in project["dependencies"] + [r for name in sys.argv[2:] for r in extras.get(name, [])]:
    print(requirement)
