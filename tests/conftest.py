import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Each test's time, setup and teardown included (a module's shared servers
# start in its first test's setup): the suite's time budget, in one place.
# `test_budget_s` and `test_limit_s` are set in pyproject.toml; `-o
# test_limit_s=0` (or `test_budget_s=0`) turns one off.
BUDGET, LIMIT = "test_budget_s", "test_limit_s"
_seconds: dict[str, float] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(BUDGET, "seconds a test may take before the run's end names it in a warning (0: no check)",
                  default="0")
    parser.addini(LIMIT, "seconds a test may take before the run fails, naming it (0: no check)", default="0")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration


def _past(config: pytest.Config, name: str) -> tuple[float, list[tuple[float, str]]]:
    """The setting `name`, and the tests that took longer, slowest first."""
    seconds = float(config.getini(name) or 0)
    return seconds, sorted(((t, node) for node, t in _seconds.items() if seconds and t > seconds), reverse=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _past(session.config, LIMIT)[1] and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    budget, over = _past(config, BUDGET)
    limit, past = _past(config, LIMIT)
    if over:
        terminalreporter.section("tests over their time budget", yellow=True)
        for seconds, node in over:
            terminalreporter.line(f"{seconds:8.1f} s  {node}")
        terminalreporter.line(f"WARNING: {len(over)} test(s) took more than {budget:g} s each (setup, call and "
                              f"teardown; {BUDGET} in pyproject.toml): share their servers, or split them",
                              yellow=True)
    if past:
        terminalreporter.section("tests past their time limit", red=True)
        for seconds, node in past:
            terminalreporter.line(f"{seconds:8.1f} s  {node}")
        terminalreporter.line(f"FAILED: {len(past)} test(s) took more than {limit:g} s each ({LIMIT} in "
                              "pyproject.toml): the run fails", red=True)


@pytest.fixture
def run_dir():
    """A short directory for sockets and logs (unix socket paths are limited
    to about 100 bytes, too few for pytest's tmp_path). Logs are kept when a
    test fails, for reading."""
    path = Path(tempfile.mkdtemp(prefix="cpc-"))
    yield path
    if not os.environ.get("CPCACHE_KEEP_RUN_DIR"):
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory):
    """A real mooncake_master on loopback for the whole session."""
    from cpcache.testing.mooncake_master import MooncakeMaster

    with MooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log") as master:
        yield master
