"""`cpcache bench state` drives one state machine through a full host pool
and reports its CPU per step."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def test_bench_state_reports_open_and_apply_per_step_with_the_pool_full():
    out = subprocess.run([sys.executable, "-m", "cpcache.tools.cli", "bench", "state", "--steps", "5", "--repeat",
                          "2", "--json"], capture_output=True, text=True, timeout=100, check=True).stdout
    figures = json.loads(out)
    assert figures["pages_written_per_step"] == 176 and figures["blocks"] == 2
    assert 0 < figures["open_us"] and 0 < figures["apply_us"]
    assert figures["open_apply_us"] == pytest.approx(figures["open_us"] + figures["apply_us"], abs=0.2)
