"""`.ci/run` ends a failed run with scripts/ci_failures.py: every failed and
errored test, named with the end of its report, read from pytest's own JUnit
report of a real run."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FAILING = '''
import pytest

@pytest.fixture
def gateway():
    raise RuntimeError("the gateway did not start")

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "one is not two"

def test_errors(gateway):
    pass
'''


@pytest.mark.timeout(60)
def test_a_failed_run_ends_naming_each_failed_and_errored_test_with_its_reason(tmp_path: Path):
    (tmp_path / "test_sample.py").write_text(FAILING)
    report = tmp_path / "report.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                          f"--rootdir={tmp_path}", f"--junitxml={report}", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode == 1, run.stdout
    recap = subprocess.run([sys.executable, str(REPO / "scripts" / "ci_failures.py"), str(report)],
                           capture_output=True, text=True, timeout=30, check=True).stdout
    assert "ci: 2 test(s) failed or errored" in recap
    assert "one is not two" in recap and "the gateway did not start" in recap
    last = recap.strip().splitlines()[-2:]
    assert last == ["ci: FAILURE test_sample::test_fails", "ci: ERROR test_sample::test_errors"]
    assert "test_passes" not in recap


def test_a_run_that_never_wrote_its_report_says_so(tmp_path: Path):
    recap = subprocess.run([sys.executable, str(REPO / "scripts" / "ci_failures.py"), str(tmp_path / "none.xml")],
                           capture_output=True, text=True, timeout=30, check=True).stdout
    assert "did not run to their end" in recap
