"""Why hits were lost, through a real SGLang server (`--tp 2
--attn-cp-size 2`, tiny random Qwen3) over `cpcache launch` daemons with
their default prefetch settings (`best_effort` with its bounded wait,
threshold 0) and file storage: the multi-turn workload of test_hit_rates,
whose documents overflow the host pool and come back from storage.

Each rank's daemon counters add up (the pages prefetches asked for = storage
hits + pages found resident + the lost pages by reason), and the storage
tokens SGLang's own cache report gives the requests (`cached_tokens_details`,
what `bench_serving --cache-report` sums) are the daemon's storage hits less
those lost after they entered the host pool. How many prefetches ended
short (pages read and thrown away) is printed, not asserted: it depends on
how fast the host reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cpcache.client import Client
from cpcache.integrations.sglang.lost_hits import parse
from cpcache.testing.sglang_cpu.servers import SGLANG_PYTHON
from cpcache.testing.sglang_cpu.stacks import PAGE, Shape, Stack, workload
from tests.sglang.stacks import References
from tests.sglang.test_hit_rates import turns
from tests.support.budget import beyond_budget

pytestmark = [
    pytest.mark.sglang,
    # Its own tp 2 / CP 2 server for three minutes: beyond the suite's budget, run with
    # CPCACHE_SGLANG_MORE=1 (tests/multirank/test_lost_hits.py checks the counters on real daemons).
    beyond_budget,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]

SHAPE = Shape("qwen3", tp=2, cp=2, storage="file")
REASONS = ("storage_miss", "below_threshold", "host_full", "revoked", "prefetch_late", "read_failed")


def test_lost_hit_counters_add_up_to_the_pages_asked_and_to_sglangs_cache_report(tmp_path: Path,
                                                                                 references: References):
    model = references.model(SHAPE.family)
    # The daemons' defaults for how a prefetch ends; no I/O faults: a measurement.
    stack = Stack(tmp_path, model, SHAPE, copy_delay_ms=0.0, storage_delay_ms=0.0, per_rank={}, with_reference=False,
                  sleep_on_idle=True, daemon_settings=dict(prefetch_policy="best_effort"))
    try:
        stack.start()
        system, docs = workload(seed=7)
        replies = [stack.cpcache.generate(ids) for ids in turns(system, docs)]
        stats = []
        for rank in range(SHAPE.tp):
            with Client(stack.daemons.socket(rank), timeout_s=10) as daemon:
                stats.append(daemon.stats())
        process = stack.cpcache.process
        assert process is not None
        stack.cpcache.flush_cache()
        lines = process.wait_lines(" lost hits: ", SHAPE.tp, timeout_s=120)
    finally:
        stack.stop()
    backend = {int(line.split("cpcache: rank ")[1].split()[0]): parse(line) for line in lines}
    report_storage = sum(r.storage for r in replies)
    assert report_storage > 0, "no storage hit: the workload did not reach storage"
    print("lost hits:", json.dumps({"report_storage_tokens": report_storage, "backend": backend, "daemons": [
        {k: v for k, v in s.items() if k.startswith(("lost_hit_pages_", "prefetch", "storage_hit"))} for s in stats]}))
    for rank, s in enumerate(stats):
        lost = {r: s[f"lost_hit_pages_{r}"] for r in REASONS}
        assert s["prefetch_asked_pages"] == s["storage_hit_pages"] + s["prefetch_resident_pages"] + sum(
            lost.values()), (rank, s)
        # Every page a prefetch brought reached its request, but those evicted or not loaded meanwhile
        # (a page another operation had brought already is the host tier's).
        gone = s["lost_hit_pages_host_evicted"] + backend[rank]["device_full"] + backend[rank]["load_failed"]
        assert report_storage == (s["storage_hit_pages"] - gone) * PAGE, (rank, s)
        assert backend[rank]["fallback"] == 0
    # The agreed counters are the same on every rank; only the split of what prefetches ended without is local.
    agreed = ("prefetch_asked_pages", "storage_hit_pages", *(f"lost_hit_pages_{r}" for r in REASONS[:4]))
    assert all({k: s[k] for k in agreed} == {k: stats[0][k] for k in agreed} for s in stats)
