"""compose.yaml's cpu profile, for real: one container per daemon (--tp 4
--cp 2), each with its own address on a bridge network, gloo and the
rendezvous store across it, a driver container replaying a trace slice
through the daemons' sockets on a shared volume; then one daemon container
killed. scripts/compose-test.sh prepares (packages as root, containers.conf,
base image, wheelhouse), builds, and runs scripts/compose_run.py; these tests
check its summary: once with compose's default storage (Mooncake, one
segment per daemon container), once with `file` storage on a shared volume,
whose storage hit rate the Mooncake run must match within 1 point."""

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "traces" / "conversation_trace.jsonl"

pytestmark = [
    pytest.mark.compose,
    pytest.mark.skipif(shutil.which("podman") is None or shutil.which("podman-compose") is None,
                       reason="podman and podman-compose are not installed: `make compose-test` installs them "
                              "(as root, Debian's packages)"),
]


def run_stack(tmp_path: Path, storage: str, build: bool = True) -> tuple[dict, str]:
    """scripts/compose-test.sh once, with this storage: (its summary, a report for failures)."""
    summary_path = tmp_path / f"summary-{storage}.json"
    # A project of its own: runs on one machine do not share containers, volumes or networks.
    env = dict(os.environ, CPCACHE_COMPOSE_PROJECT=f"cpctest{uuid.uuid4().hex[:6]}", CPCACHE_COMPOSE_STORAGE=storage)
    if not build:
        env["CPCACHE_COMPOSE_NO_BUILD"] = "1"
    result = subprocess.run([str(REPO / "scripts" / "compose-test.sh"), "--json-out", str(summary_path)],
                            capture_output=True, text=True, timeout=1700, env=env)
    assert summary_path.exists(), result.stderr[-6000:]
    summary = json.loads(summary_path.read_text())
    summary["returncode"] = result.returncode
    return summary, json.dumps(summary, indent=1)[-6000:] + "\n" + result.stderr[-4000:]


@pytest.fixture(scope="module")
def mooncake_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """The stack as compose.yaml runs it by default: Mooncake storage."""
    return run_stack(tmp_path_factory.mktemp("mooncake"), "mooncake")


@pytest.mark.timeout(1800)  # a first build (base image, torch, dependencies) included
def test_cpu_profile_replays_across_containers_and_names_a_killed_daemon(mooncake_run):
    summary, report = mooncake_run
    replay = summary["replay"]
    assert replay["ranks"] == 4 and replay["requests"] > 0, report
    assert replay["storage"] == "mooncake", report  # compose's default
    assert replay["divergences"] == 0, report
    assert replay["identical_decision_logs"], report
    assert replay["corrupt_loads"] == 0 and replay["verified_pages"] > 0, report  # load-backs happened, all intact
    # Pages written by one container are found by the others: each daemon
    # mounted its Mooncake segment at its own container's name.
    assert replay["hit_rate"]["storage"] > 0 and summary["storage_hits"], report
    assert summary["mooncake"]["segment_per_daemon"], report
    assert set(summary["healthchecks"].values()) == {"healthy"}, report  # each service's own check passes
    kill = summary["kill"]
    assert kill["killed"] == 3 and sorted(kill["survivors"]) == ["0", "1", "2"], report
    for rank, answer in kill["survivors"].items():  # UNAVAILABLE naming exactly the killed rank
        assert answer["status"] == "UNAVAILABLE" and answer["missing_ranks"] == [3], (rank, report)
    assert summary["killed_container"].startswith("exited"), report
    assert summary["left_over"] == {}, report  # down took everything with it
    assert summary["passed"] and summary["returncode"] == 0, report


@pytest.mark.timeout(1800)
def test_mooncake_storage_hits_match_file_storage_on_the_same_slice(mooncake_run, tmp_path):
    """Mooncake across containers finds what a `file` root on a shared
    volume finds: storage hit rates within 1 point on the same trace slice
    (the replay's decisions are agreed, so the two runs differ only where a
    backend loses or misses pages)."""
    # The replays only: the other checks (health, kill, re-form) are the other test's.
    mooncake, mooncake_report = mooncake_run
    assert mooncake["replay"]["passed"] and mooncake["replay"]["storage"] == "mooncake", mooncake_report
    file, file_report = run_stack(tmp_path, "file", build=False)  # the image the first run built
    assert file["replay"]["passed"] and file["replay"]["storage"] == "file", file_report
    assert file["replay"]["requests"] == mooncake["replay"]["requests"], file_report
    rates = {"mooncake": mooncake["replay"]["hit_rate"], "file": file["replay"]["hit_rate"]}
    assert rates["file"]["storage"] > 0, (rates, file_report)
    assert abs(rates["mooncake"]["storage"] - rates["file"]["storage"]) <= 0.01, (rates, mooncake_report, file_report)
