"""SGLang's own device pools, built on this CPU host in SGLang's environment
(pools_worker.py), through cpcache's geometry check: MLA's pool is one
latent per token; DSA's (DeepSeek V3.2: MLA plus the indexer's keys and
scales, a second part of every page) is refused with the part named, since
a page cpcache stored or restored without its indexer keys would be a wrong
hit. The decode store refuses that part too (test_decode_store.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpcache.testing.sglang_cpu.servers import SGLANG_PYTHON
from tests.sglang.stacks import run_sglang_worker

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]
WORKER = Path(__file__).resolve().parent / "pools_worker.py"


def test_mla_pools_have_one_latent_part_and_dsa_pools_with_indexer_keys_are_refused():
    out = run_sglang_worker(WORKER)
    assert out["dsa_parts"] == ["kv", "indexer"]
    assert out["dsa_device"].startswith("refused:") and "indexer" in out["dsa_device"], out
    assert "kv_kind='mla'" in out["mla_device"] and "head_dim=576" in out["mla_device"], out
