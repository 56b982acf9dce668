"""The base `cpcache` distribution is what goes into an inference server's
environment: it must not ask for torch (SGLang pins its own), and installing
it into SGLang's environment must leave that torch as it was."""

import json
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from cpcache.testing.sglang_cpu.gateway import INDEX_ONLY, smg
from tests.sglang.test_backend import SGLANG_PYTHON

ROOT = Path(__file__).resolve().parents[2]
DAEMON_ONLY = {"torch", "uvloop", "xxhash", "prometheus-client", "grpcio-reflection"}

pytestmark = pytest.mark.timeout(120)


def test_base_distribution_requires_no_torch_and_the_daemon_extra_does():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {Requirement(r).name for r in project["dependencies"]}
    assert not base & DAEMON_ONLY, f"the base distribution asks for daemon packages: {base & DAEMON_ONLY}"
    assert {Requirement(r).name for r in project["optional-dependencies"]["daemon"]} >= DAEMON_ONLY


@pytest.mark.sglang
@pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="SGLang's environment is not built; `make setup` builds it")
def test_installed_in_sglangs_environment_cpcache_leaves_its_torch_alone():
    probe = ("import importlib.metadata as m, json; "
             "print(json.dumps([m.requires('cpcache'), m.version('torch'), m.version('sglang')]))")
    requires, torch_version, sglang_version = json.loads(
        subprocess.run([str(SGLANG_PYTHON), "-c", probe], check=True, capture_output=True, timeout=60).stdout)
    unconditional = [Requirement(r) for r in requires if Requirement(r).marker is None]
    assert "torch" not in {r.name for r in unconditional}
    assert sglang_version == "0.5.23"
    assert torch_version.startswith("2.13.0"), f"SGLang's environment has torch {torch_version}"
    # What the integration imports loads there without the daemon's packages.
    subprocess.run([str(SGLANG_PYTHON), "-c", "import cpcache.client.session, cpcache.integrations.sglang.timing"],
                   check=True, timeout=60)


@pytest.mark.sglang
@pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="SGLang's environment is not built; `make setup` builds it")
def test_the_gateway_the_kit_starts_is_shepherd_model_gateway_whichever_package_owns_the_smg_script():
    # SGLang's router package installs an `smg` script too (its own router,
    # without the gateway's options); the kit runs smg's module instead.
    command = smg()
    assert command[1:] == ["-P", "-m", "smg"]
    help_text = subprocess.run([*command, "launch", "--help"], capture_output=True, text=True, timeout=60,
                               check=True).stdout
    assert all(flag in help_text for flag in INDEX_ONLY[::2]), help_text[-2000:]
