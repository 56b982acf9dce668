"""cpcache: a hierarchical KV-cache service whose every decision is agreed by
all ranks of an agreement domain."""

# The one place the release is written: the package's metadata takes it from
# here (pyproject.toml, [tool.setuptools.dynamic]), so a source checkout and
# an installed wheel say the same; CHANGELOG.md has a section for each.
__version__ = "0.2.0"
