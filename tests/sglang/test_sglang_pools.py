"""SGLang's own device pools, built on this CPU host in SGLang's environment
(pools_worker.py), through cpcache's geometry check: MLA's pool is one
latent per token; DSA's (DeepSeek V3.2: MLA plus the indexer's keys and
scales, a second part of every page) is refused with the part named, since
a page cpcache stored or restored without its indexer keys would be a wrong
hit. The decode store refuses that part too (test_decode_store.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from cpcache.testing.sglang_cpu.servers import CPU_HOST, SGLANG_PYTHON, sglang_interpreter

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]
WORKER = Path(__file__).resolve().parent / "pools_worker.py"
ROOT = Path(__file__).resolve().parents[2]


def test_mla_pools_have_one_latent_part_and_dsa_pools_with_indexer_keys_are_refused():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CPU_HOST), str(ROOT)])}
    done = subprocess.run([sglang_interpreter(), str(WORKER)], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["dsa_parts"] == ["kv", "indexer"]
    assert out["dsa_device"].startswith("refused:") and "indexer" in out["dsa_device"], out
    assert "kv_kind='mla'" in out["mla_device"] and "head_dim=576" in out["mla_device"], out
