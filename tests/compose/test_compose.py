"""compose.yaml's cpu profile, for real: one container per daemon (--tp 4
--cp 2), each with its own address on a bridge network, gloo and the
rendezvous store across it, a driver container replaying a trace slice
through the daemons' sockets on a shared volume; then one daemon container
killed. scripts/compose-test.sh prepares (packages as root, containers.conf,
base image, wheelhouse), builds, and runs scripts/compose_run.py; this test
checks its summary."""

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO.parent / "shared" / "traces" / "conversation_trace.jsonl"

pytestmark = [
    pytest.mark.compose,
    pytest.mark.skipif(shutil.which("podman") is None or shutil.which("podman-compose") is None,
                       reason="podman and podman-compose are not installed: `make compose-test` installs them "
                              "(as root, Debian's packages)"),
    pytest.mark.skipif(not TRACE.exists(), reason=f"the trace {TRACE} is not here"),
]


@pytest.mark.timeout(1800)  # a first build (base image, torch, dependencies) included
def test_cpu_profile_replays_across_containers_and_names_a_killed_daemon(tmp_path):
    summary_path = tmp_path / "summary.json"
    # A project of its own: runs on one machine do not share containers, volumes or networks.
    env = dict(os.environ, CPCACHE_COMPOSE_PROJECT=f"cpctest{uuid.uuid4().hex[:6]}")
    result = subprocess.run([str(REPO / "scripts" / "compose-test.sh"), "--json-out", str(summary_path)],
                            capture_output=True, text=True, timeout=1700, env=env)
    assert summary_path.exists(), result.stderr[-6000:]
    summary = json.loads(summary_path.read_text())
    report = json.dumps(summary, indent=1)[-6000:] + "\n" + result.stderr[-4000:]
    replay = summary["replay"]
    assert replay["ranks"] == 4 and replay["requests"] > 0, report
    assert replay["divergences"] == 0, report
    assert replay["identical_decision_logs"], report
    assert replay["corrupt_loads"] == 0 and replay["loaded_pages"] > 0, report  # load-backs happened, all intact
    assert set(summary["healthchecks"].values()) == {"healthy"}, report  # each service's own check passes
    kill = summary["kill"]
    assert kill["killed"] == 3 and sorted(kill["survivors"]) == ["0", "1", "2"], report
    for rank, answer in kill["survivors"].items():  # UNAVAILABLE naming exactly the killed rank
        assert answer["status"] == "UNAVAILABLE" and answer["missing_ranks"] == [3], (rank, report)
    assert summary["killed_container"].startswith("exited"), report
    assert summary["left_over"] == {}, report  # down took everything with it
    assert summary["passed"] and result.returncode == 0, report
