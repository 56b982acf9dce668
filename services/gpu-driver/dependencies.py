"""Which distributions the GPU check needs and where each comes from: the
host's own install, or a wheel carried in `services/gpu-driver/wheels/`.

Runs before anything of the project is importable, so it uses only the
standard library and `packaging` (pytest's own dependency, so on any host
that can run the tests). Nothing is installed: the chosen wheels are
unpacked into a scratch folder that goes first on PYTHONPATH.
"""

from __future__ import annotations

import importlib.util
import re
import tomllib
import zipfile
from dataclasses import dataclass, field
from email.parser import HeaderParser
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

# What runs the tests, from the dev extra (the rest of it lints and plots).
TEST_RUNNERS = ("pytest", "pytest-asyncio", "pytest-timeout")
# The minimums the generated code in cpcache/v1 checks when it is imported.
_PROTOBUF_GENCODE = re.compile(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*"
                               r"(\d+),\s*(\d+),\s*(\d+),")
_GRPC_GENCODE = re.compile(r"GRPC_GENERATED_VERSION = '([^']+)'")


def roots(repo: Path) -> list[Requirement]:
    """The base dependencies, the daemon extra and the test runners, for this
    interpreter (markers evaluated), and the versions cpcache/v1's generated
    code requires."""
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    dev = [Requirement(r) for r in project["optional-dependencies"]["dev"]]
    wanted = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["daemon"]]
    wanted += [r for r in dev if canonicalize_name(r.name) in TEST_RUNNERS]
    wanted += [Requirement(f"{name}>={version}") for name, version in gencode_minimums(repo).items()]
    return [r for r in wanted if r.marker is None or r.marker.evaluate()]


def gencode_minimums(repo: Path) -> dict[str, str]:
    """The protobuf runtime and grpcio versions cpcache/v1's generated code
    refuses to load below."""
    generated = repo / "cpcache/v1"
    if not generated.is_dir():  # an installed cpcache beside the tests (the compose driver's image)
        spec = importlib.util.find_spec("cpcache")
        assert spec is not None and spec.origin is not None, "cpcache is neither in the source tree nor installed"
        generated = Path(spec.origin).parent / "v1"
    pb2 = (generated / "daemon_pb2.py").read_text()
    grpc = (generated / "daemon_pb2_grpc.py").read_text()
    found_pb2, found_grpc = _PROTOBUF_GENCODE.search(pb2), _GRPC_GENCODE.search(grpc)
    assert found_pb2 and found_grpc, "cpcache/v1 no longer carries its version checks"
    return {"protobuf": ".".join(found_pb2.groups()), "grpcio": found_grpc.group(1)}


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str
    version: Version

    def requires(self) -> list[Requirement]:
        with zipfile.ZipFile(self.path) as archive:
            meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            headers = HeaderParser().parsestr(archive.read(meta).decode())
        out = []
        for line in headers.get_all("Requires-Dist") or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                out.append(requirement)
        return out


def carried_wheels(folder: Path) -> dict[str, list[Wheel]]:
    """The wheels in `folder` this interpreter can load, by name, newest first."""
    supported = set(sys_tags())
    out: dict[str, list[Wheel]] = {}
    for path in sorted(folder.glob("*.whl")) if folder.is_dir() else []:
        name, version, _, tags = parse_wheel_filename(path.name)
        if supported & set(tags):
            out.setdefault(name, []).append(Wheel(path, name, version))
    for wheels in out.values():
        wheels.sort(key=lambda w: w.version, reverse=True)
    return out


def host_version(name: str) -> Version | None:
    try:
        return Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        return None


def host_satisfies(want: SpecifierSet, version: Version) -> bool:
    """Whether a host's install meets `want`; a pre-release or dev build
    counts as the release it leads to (NVIDIA's containers carry torch as
    2.11.0a0+...), since it is what the host runs and nothing can replace it."""
    if want.contains(version, prereleases=True):
        return True
    return (version.is_prerelease or version.is_devrelease) and want.contains(Version(version.base_version))


@dataclass
class Choice:
    name: str
    required: str  # the specifiers every requirement seen asks of it
    host: str | None  # the version the host has, if any
    origin: str  # "host", "carried" or "missing"
    version: str | None = None
    wheel: Wheel | None = field(default=None, repr=False)

    def report(self) -> dict:
        return {"name": self.name, "required": self.required, "host": self.host, "origin": self.origin,
                "version": self.version}


def resolve(wanted: list[Requirement], wheels: dict[str, list[Wheel]]) -> list[Choice]:
    """A version of each wanted distribution: the host's where it satisfies
    every requirement on it, else the newest carried wheel that does. A
    carried wheel's own requirements are wanted too; the host's installs
    are taken as they are."""
    specs: dict[str, SpecifierSet] = {}
    order: list[str] = []
    pending = list(wanted)
    chosen: dict[str, Choice] = {}
    while pending:
        requirement = pending.pop(0)
        name = canonicalize_name(requirement.name)
        if name not in specs:
            order.append(name)
        specs[name] = specs.get(name, SpecifierSet()) & requirement.specifier
        want = specs[name]
        held = chosen.get(name)
        if held is not None and held.version is not None and want.contains(held.version, prereleases=True):
            held.required = str(want)
            continue
        host = host_version(name)
        if host is not None and host_satisfies(want, host):
            chosen[name] = Choice(name, str(want), str(host), "host", str(host))
            continue
        wheel = next((w for w in wheels.get(name, []) if want.contains(w.version, prereleases=True)), None)
        if wheel is None:
            chosen[name] = Choice(name, str(want), str(host) if host else None, "missing")
            continue
        chosen[name] = Choice(name, str(want), str(host) if host else None, "carried", str(wheel.version), wheel)
        pending += wheel.requires()
    return [chosen[name] for name in order]


def unpack(choices: list[Choice], site: Path) -> None:
    """Unpack the carried wheels chosen into `site` (a folder for PYTHONPATH):
    what `pip install --no-deps --target` would leave, without pip."""
    site.mkdir(parents=True, exist_ok=True)
    for choice in choices:
        if choice.wheel is None:
            continue
        with zipfile.ZipFile(choice.wheel.path) as archive:
            for member in archive.infolist():
                parts = member.filename.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue  # scripts and headers: not needed to import
                    member.filename = "/".join(parts[2:])
                archive.extract(member, site)
