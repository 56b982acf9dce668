"""services/gpu-driver/run.sh on a host without CUDA fails at once, clearly,
with its own exit code, having written only its small summary; and its
dependency check takes the host's packages or carried wheels; a phase's
output, whatever it is, ends in the summary."""

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from tests.support import gpu_driver

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "services/gpu-driver/run.sh"
NO_CUDA, USAGE = 3, 2


def run_sh(*args: str, out: Path | None = None) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    if out is not None:
        env["OUT"] = str(out)
    start = time.monotonic()
    done = subprocess.run(["bash", str(RUN), *args], env=env, capture_output=True, text=True, timeout=50)
    return done, time.monotonic() - start


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path of a host without CUDA")
def test_without_cuda_it_fails_fast_and_clearly(tmp_path):
    out = tmp_path / "out"
    done, seconds = run_sh(out=out)
    assert done.returncode == NO_CUDA, done.stdout + done.stderr
    assert "no CUDA device" in done.stdout and "run this on a CUDA host" in done.stdout
    assert seconds < 30
    assert [p.name for p in out.iterdir()] == ["gpu-summary.json"]
    assert (out / "gpu-summary.json").stat().st_size < 16 << 10
    summary = json.loads((out / "gpu-summary.json").read_text())
    assert (summary["ok"], summary["exit_code"]) == (False, NO_CUDA)
    assert summary["cuda"]["available"] is False
    assert list(summary["phases_s"]) == ["probe"]  # neither the tests nor the bench started
    assert set(summary["versions"]) == {"grpcio", "protobuf", "torch"}
    assert set(summary["gencode_minimums"]) == {"grpcio", "protobuf"}


def test_without_a_folder_it_says_how_to_call_it():
    done, _ = run_sh()
    assert done.returncode == USAGE
    assert "usage: run.sh OUT_DIR" in done.stderr


@pytest.fixture(scope="module")
def dependencies():
    return gpu_driver.dependencies()


def fake_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}/__init__.py", f"VERSION = {version!r}\n")
        archive.writestr(f"{name}-{version}.dist-info/METADATA",
                         f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{meta}")
    return path


def test_the_host_first_then_carried_wheels_then_missing(dependencies, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_wheel(wheels, "cpcache_fake_a", "1.0", requires=("cpcache-fake-b>=2", "pytest>=1"))
    fake_wheel(wheels, "cpcache_fake_b", "1.5")
    fake_wheel(wheels, "cpcache_fake_b", "2.1")
    wanted = [Requirement("pytest>=1"), Requirement("cpcache-fake-a>=1"), Requirement("cpcache-fake-c")]
    choices = {c.name: c for c in dependencies.resolve(wanted, dependencies.carried_wheels(wheels))}
    assert choices["pytest"].origin == "host"
    assert (choices["cpcache-fake-a"].origin, choices["cpcache-fake-a"].version) == ("carried", "1.0")
    assert (choices["cpcache-fake-b"].origin, choices["cpcache-fake-b"].version) == ("carried", "2.1")
    assert choices["cpcache-fake-c"].origin == "missing"
    dependencies.unpack(list(choices.values()), tmp_path / "site")
    assert sorted(p.name for p in (tmp_path / "site").iterdir() if not p.name.endswith(".dist-info")) == [
        "cpcache_fake_a", "cpcache_fake_b"]


def test_a_host_package_too_old_is_not_taken(dependencies, tmp_path):
    (choice,) = dependencies.resolve([Requirement("pytest>=999")], {})
    assert (choice.origin, choice.host) == ("missing", __import__("pytest").__version__)


@pytest.fixture
def driver_run(tmp_path):
    driver = gpu_driver.driver()
    run = driver.Run(tmp_path / "out")
    yield driver, run
    shutil.rmtree(run.scratch, ignore_errors=True)


def test_a_phase_that_prints_bytes_that_are_not_text_still_has_its_output_read(driver_run):
    _, run = driver_run
    done = run.phase("bench", [sys.executable, "-c", "import sys; sys.stdout.buffer.write(b'report \\xff\\xfe')"])
    assert done.returncode == 0 and done.stdout.startswith("report ")


def test_a_bench_that_prints_no_report_fails_with_what_it_printed(driver_run, monkeypatch):
    driver, run = driver_run
    monkeypatch.setattr(run, "phase", lambda name, argv: subprocess.CompletedProcess(argv, 0, "warming up\n", ""))
    with pytest.raises(driver.Stop) as stopped:
        driver.bandwidth(run)
    assert stopped.value.code == driver.FAILED and "no JSON report" in str(stopped.value)
    assert "warming up" in run.summary["bench_output_tail"]


def test_a_host_pre_release_of_a_version_that_fits_is_taken(dependencies, monkeypatch):
    monkeypatch.setattr(dependencies, "host_version", lambda name: Version("2.11.0a0+nv26.1"))
    (choice,) = dependencies.resolve([Requirement("torch>=2.11,<3")], {})
    assert (choice.origin, choice.version) == ("host", "2.11.0a0+nv26.1")
    (older,) = dependencies.resolve([Requirement("torch>=2.12")], {})
    assert older.origin == "missing"


def test_without_a_venv_it_runs_the_python_that_has_torch(tmp_path):
    """A host whose python3 lacks torch while its python has it (a bare
    system python3 beside a container's interpreter)."""
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    (repo / "services/gpu-driver").mkdir(parents=True)
    shutil.copy(RUN, repo / "services/gpu-driver/run.sh")
    (repo / "services/gpu-driver/driver.py").write_text("import sys\nprint('driver ran by', sys.argv[1])\n")
    bin_dir.mkdir()
    bare = bin_dir / "python3"  # answers the torch check with "no", and would say so if it ran the driver
    bare.write_text("#!/bin/sh\ncase \"$2\" in *find_spec*) exit 1;; esac\necho 'driver ran by the bare python3'\n")
    bare.chmod(0o755)
    with_torch = bin_dir / "python"
    with_torch.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    with_torch.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(["/bin/bash", str(repo / "services/gpu-driver/run.sh"), "with-torch"], env=env,
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "driver ran by with-torch"
