"""`.ci/run` ends a failed run with scripts/ci_failures.py: every failed and
errored test, named with the end of its report, read from pytest's own JUnit
report of a real run."""

import os
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
                         capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"})
    assert run.returncode == 1, run.stdout
    recap = subprocess.run([sys.executable, str(REPO / "scripts" / "ci_failures.py"), str(report)],
                           capture_output=True, text=True, timeout=30, check=True).stdout
    assert "ci: 2 test(s) failed or errored, 0 past the time limit" in recap
    assert "one is not two" in recap and "the gateway did not start" in recap
    last = recap.strip().splitlines()[-2:]
    assert last == ["ci: FAILURE test_sample::test_fails", "ci: ERROR test_sample::test_errors"]
    assert "test_passes" not in recap


def recap_of(report: Path) -> str:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "ci_failures.py"), str(report)],
                          capture_output=True, text=True, timeout=30, check=True).stdout


def test_a_test_past_the_time_limit_is_named_though_it_passed(tmp_path: Path):
    report = tmp_path / "report.xml"
    report.write_text('<testsuites><testsuite><testcase classname="tests.sglang.test_slow" name="test_slow" '
                      'time="4000.5"/><testcase classname="tests.unit.test_quick" name="test_quick" time="0.1"/>'
                      '</testsuite></testsuites>')
    recap = recap_of(report)
    assert "ci: 0 test(s) failed or errored, 1 past the time limit" in recap
    assert recap.strip().splitlines()[-1] == "ci: PAST THE TIME LIMIT (4000 s) tests.sglang.test_slow::test_slow"


def test_a_missing_or_cut_report_is_said_not_a_traceback(tmp_path: Path):
    assert "failed before pytest wrote it" in recap_of(tmp_path / "none.xml")
    cut = tmp_path / "cut.xml"
    cut.write_text('<testsuites><testsuite><testcase classname="a" name=')
    assert "cannot be read" in recap_of(cut)
