"""The KV events the backend queues for the host pool and storage
(cpcache/integrations/sglang/tier_events.py), in SGLang's environment: their
block hashes, parents, tokens, salts and LoRA names equal those SGLang's own
unified radix cache publishes for the same tokens on its device tier (plain,
cache salt, extra key, LoRA adapter, the dynamo format), and they decode
with SGLang's `KVEventBatch` as its publisher sends them, with the media
each tier has: CPU_PINNED for the host pool, DISK for file storage, EXTERNAL
for Mooncake. `events_worker.py` runs there and reports; checked here."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.sglang.test_backend import SGLANG_PYTHON

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="SGLang's environment is not built; `make setup` builds it"),
]
WORKER = Path(__file__).resolve().parent / "events_worker.py"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report() -> dict:
    out = subprocess.run([str(SGLANG_PYTHON), str(WORKER)], capture_output=True, text=True, timeout=200,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


def as_medium(pages: list[dict], medium: str) -> list[dict]:
    return [{**page, "medium": medium} for page in pages]


def stored(*pages: list[dict]) -> list[dict]:
    return [{"type": "BlockStored", "pages": p} for p in pages]


def removed(medium: str, *hashes: int) -> dict:
    return {"type": "BlockRemoved", "hashes": list(hashes), "medium": medium}


CASES = ("plain", "cache_salt", "extra_key", "lora", "lora_and_salt", "dynamo", "dynamo_lora")


@pytest.mark.parametrize("case", CASES)
def test_page_events_equal_sglangs_own_for_the_same_tokens(report, case):
    got = report["cases"][case]
    assert len(got["sglang"]) == 4, got["sglang"]
    assert got["backend"] == got["sglang"]
    if "lora" in case:
        assert {p["lora_name"] for p in got["sglang"]} == {"adapter-a"}


def test_namespaces_give_other_hashes_as_sglangs_do(report):
    first = {case: report["cases"][case]["sglang"][0]["hash"] for case in CASES}
    assert first["extra_key"] == first["plain"]  # an extra key that names no adapter leaves SGLang's hashes alone
    assert first["dynamo_lora"] == first["lora"]  # the same seed: the extra key's, without a salt
    assert len({first[c] for c in ("plain", "cache_salt", "lora", "lora_and_salt", "dynamo")}) == 5


@pytest.mark.parametrize("case", CASES)
def test_each_tier_turn_publishes_sglangs_events_with_its_medium(report, case):
    own = report["cases"][case]["sglang"]
    h = [p["hash"] for p in own]
    tiers = report["cases"][case]["tiers"]
    # Pages entering the host pool in one round (listed in hash order) go out in chain order, coalesced.
    assert tiers["host_entered"] == stored(as_medium(own, "CPU_PINNED"))
    # A stored backup's pages (as the reply names them) in file storage; a failed backup's are not.
    assert tiers["backups"] == stored(as_medium(own[:3], "DISK"))
    # A page published stored that an agreed lookup finds missing is removed; a page never stored is not.
    assert tiers["lookups"] == [removed("DISK", h[1], h[2])]
    assert tiers["host_left"] == [removed("CPU_PINNED", h[3], h[1])]
    # The daemon lost: the host pool is no tier; the pages a new session carries over come back.
    assert tiers["host_lost"] == [removed("CPU_PINNED", h[0], h[2])]
    assert tiers["carried_over"] == stored(as_medium(own[:1], "CPU_PINNED"), as_medium(own[2:3], "CPU_PINNED"))
    # /clear_hicache_storage: what the host pool and storage hold is never matched again.
    assert tiers["left_behind"] == [removed("CPU_PINNED", h[0], h[2]), removed("DISK", h[0])]
    # After a flush (SGLang's own AllBlocksCleared), older pages' evictions are not published.
    assert tiers["after_flush"] == []
    assert tiers["counters"]["unnamed_pages"] == 1  # a page nobody here named is not published
    assert tiers["counters"]["dropped_events"] == 0


def test_mooncake_is_external_and_the_queue_is_bounded(report):
    bounded = report["bounded"]
    assert bounded["medium"] == "EXTERNAL"
    assert [e["pages"][0]["medium"] for e in bounded["queued"]] == ["CPU_PINNED", "EXTERNAL"]
    assert bounded["dropped"] == 1  # the removal found the queue full: dropped and counted, nothing waited
