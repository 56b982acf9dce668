"""The package's metadata admits what a lent GPU host has (Python 3.12,
torch 2.11 with CUDA 13), and its protobuf and grpcio floors are the ones
cpcache/v1's generated code checks when it is imported."""

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support import gpu_driver

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
GPU_HOST = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}


def requirements(*extras: str) -> list[Requirement]:
    lines = PROJECT["dependencies"] + [r for e in extras for r in PROJECT["optional-dependencies"][e]]
    found = [Requirement(line) for line in lines]
    return [r for r in found if r.marker is None or r.marker.evaluate(GPU_HOST)]


def floor(name: str) -> Version:
    (spec,) = [s for r in requirements() if canonicalize_name(r.name) == name for s in r.specifier
               if s.operator == ">="]
    return Version(spec.version)


def test_python_3_12_is_admitted():
    assert SpecifierSet(PROJECT["requires-python"]).contains("3.12.3")


@pytest.mark.parametrize("torch", ["2.11.0", "2.11.0+cu130"])
def test_the_daemon_extra_admits_torch_2_11(torch):
    (pin,) = [r for r in requirements("daemon") if r.name == "torch"]
    assert pin.specifier.contains(torch), f"the daemon extra pins {pin}, which refuses torch {torch}"


def test_no_requirement_is_dropped_on_python_3_12():
    """Every requirement of the base package, the daemon and the tests applies
    there (none is limited by a marker to other Pythons)."""
    lines = PROJECT["dependencies"] + PROJECT["optional-dependencies"]["daemon"]
    assert len(requirements("daemon")) == len(lines)


def test_protobuf_and_grpcio_floors_are_the_generated_codes():
    """The generated code refuses a protobuf runtime older than the protoc
    that wrote it and a grpcio older than the grpcio-tools that did: the
    floors say exactly that, no more."""
    gencode = gpu_driver.dependencies().gencode_minimums(REPO)
    assert floor("protobuf") == Version(gencode["protobuf"])
    assert floor("grpcio") == Version(gencode["grpcio"])
    (tools,) = [r for r in requirements("dev") if r.name == "grpcio-tools"]
    assert tools.specifier.contains(gencode["grpcio"])  # regenerating keeps the floors


def test_the_release_is_written_once():
    """The metadata's version is cpcache.__version__ (read at build time), and
    CHANGELOG.md's newest release is that version."""
    import re

    import cpcache

    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    dynamic = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["dynamic"]
    assert dynamic["version"] == {"attr": "cpcache.__version__"}
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", (REPO / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert releases and releases[0] == cpcache.__version__, "CHANGELOG.md has no section for this release"
