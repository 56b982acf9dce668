"""SGLang's own device pools, built on this CPU host in SGLang's environment
with the cpcache plugin's shared-memory allocation (pools_worker.py): MLA's
pool is one latent per token; DSA's (DeepSeek V3.2: MLA plus the indexer's
keys and scales) has a second part of every page, declared in the geometry
and handed over in place with the KV. A DSA page taken device -> host ->
file -> host -> SGLang's own buffers comes back whole, every buffer of it,
and a page whose indexer bytes are lost in storage is not read back. (The
decode store, which sees SGLang's host pools, still refuses the indexer part:
test_decode_store.py.)"""

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


def test_a_dsa_pool_hands_over_its_indexer_beside_the_kv_and_its_pages_come_back_whole():
    out = run_sglang_worker(WORKER)
    assert "kv_kind='mla'" in out["mla_geometry"] and "beside=()" in out["mla_geometry"], out
    assert out["dsa_parts"] == ["kv", "indexer"]
    # 64 tokens x (128 key bytes + 4 scale bytes) per layer and page
    assert "PagePart(name='indexer', rows_per_page=1, width=8448, dtype='uint8')" in out["dsa_geometry"], out
    assert out["dsa_regions"] == 4  # 2 layers of latent, then 2 of indexer
    assert out["index_read_waits_for"] == [1]  # SGLang's indexer waits for the layer's load, as attention does
    assert out["read_back"] == 2
    assert out["equal_buffers"] == [True] * 4, out  # both layers' latent and both layers' indexer rows
    assert out["other_pages_zero"], out
    assert out["after_part_lost"][1] == 1, out  # the page without its indexer bytes is not read
