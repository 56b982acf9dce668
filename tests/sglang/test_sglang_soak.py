"""`cpcache bench sglang-soak` for a minute, through the CLI as a user
runs it: a CP server (tp 2, attention CP 2) over cpcache daemons under
cache-heavy traffic, I/O perturbed per rank (one rank slower, a share of its
storage reads failing). Every reply checked, no hang, no divergence."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cpcache.testing.sglang_cpu.servers import SGLANG_PYTHON

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]

CPCACHE = Path(sys.executable).parent / "cpcache"


def test_a_minute_of_cache_heavy_traffic_on_a_cp_server_serves_every_reply_right(tmp_path: Path):
    # A minute in the suite; docs/benchmarks.md's soaks run 30.
    run = subprocess.run([str(CPCACHE), "bench", "sglang-soak", "--minutes", "1", "--json",
                          "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=1100)
    assert run.stdout.strip(), f"no report (exit {run.returncode}):\n{run.stderr[-3000:]}"
    report = json.loads(run.stdout.strip().splitlines()[-1])
    print("sglang-soak:", json.dumps(report))
    assert report["requests"] > 0 and report["fallbacks"] == 0
    assert report["wrong"] == 0, report["first_wrong"]
    assert report["hangs"] == 0 and report["errors"] == 0
    assert report["divergences"] == 0 and report["decision_logs_agree"], report["decision_logs"]
    assert report["hit_tokens"]["host"] > 0 and report["hit_tokens"]["storage"] > 0, report["hit_tokens"]
    assert run.returncode == 0, run.stderr[-3000:]
