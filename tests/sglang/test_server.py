"""SGLang serves with cpcache: real `python -m sglang.launch_server` servers
(spawned schedulers, HTTP /generate) at tp 2 on the CPU, a tiny random Llama
made here, over `cpcache launch` daemons with file storage.

Copies between the device and the host pools are slowed on every rank
independently (fault injection), so steps overlap I/O and ranks end it at
different times. A workload whose prefixes leave the device pool and come
back (a shared
system prompt, documents that overflow the device pool and, with a small
host pool, the host pool too) is sent to a cpcache server and to a
`--disable-radix-cache` server; every reply must match, token for token and
logprob for logprob. A page planted in storage (a valid frame around wrong
bytes) must break that match: the check sees wrong KV. Then (with
CPCACHE_SGLANG_MORE=1; test_cp.py runs both under the seed's shape) the
cache is flushed while writes are queued and requests are aborted during
their prefetch; and a daemon is killed while loads, writes and prefetches
are in flight: the server keeps answering correctly (and
passes SGLang's own idle leak check while the daemon is dead), both ranks
leave the daemon at the same iteration, and come back to it at the same
iteration once the launcher has restarted it.

Runs alone with `make test-sglang` (or `pytest -m sglang tests/sglang`).
"""

from __future__ import annotations

import re
import urllib.request

import pytest

from cpcache.testing.sglang_cpu.servers import SGLANG_PYTHON
from cpcache.testing.sglang_cpu.stacks import Shape, Stack, prompt, workload
from tests.sglang.stacks import (
    References,
    a_wrong_stored_page_breaks_the_match,
    flush_with_writes_in_flight_serves_no_wrong_bytes,
    kill_daemon_mid_run_and_come_back,
    requests_aborted_during_their_prefetch_are_revoked_on_every_rank,
    stack_of,
)
from tests.support.budget import beyond_budget

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                       "`make setup` builds it"),
]

SHAPE = Shape("llama", tp=2)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, references: References):
    # The blocking load-back: this file's daemon killed mid-load is served on
    # (a dead daemon is no tiers); with the overlapped one (the default,
    # test_load_back.py) a daemon lost while a forward reads its load stops
    # the rank instead, as a copy failing there does.
    with stack_of(SHAPE, tmp_path_factory.mktemp("sglang"), references, backend={"load_back": "blocking"}) as stack:
        yield stack


IN_PLACE = re.compile(r"rank (\d+) KV in place: before attach (\S+); after attach (\S+)")


def test_sglang_kv_buffers_stay_where_they_are_and_the_daemons_map_them(stack: Stack):
    """Each scheduler logs the address of every layer's K and V buffer as it
    handed them to its daemon and as its model runner holds them once the
    daemon has attached: the same (nothing moved, nothing copied); the host
    hits of the next test are the daemons' movers writing into them."""
    seen: dict[int, set[tuple[str, str]]] = {}
    for line in stack.cpcache.log_lines("KV in place"):
        match = IN_PLACE.search(line)
        assert match, line
        seen.setdefault(int(match[1]), set()).add((match[2], match[3]))
    assert sorted(seen) == list(range(SHAPE.tp)), f"not every rank reported its buffers: {seen}"
    for rank, reports in seen.items():
        for before, after in reports:
            assert before == after, f"rank {rank}'s KV buffers moved at attach"
            layers = before.split(",")
            assert len(layers) > 1 and all(len(layer.split("/")) == 2 for layer in layers), before
    assert stack.cpcache.log_lines("allocated in shared memory"), "SGLang's pool was not allocated in shared memory"


def test_outputs_equal_a_server_without_cache_and_hits_come_from_every_tier(stack: Stack):
    system, docs = workload()
    replies = [stack.check(prompt(system, doc, 0, d)) for d, doc in enumerate(docs)]
    # Back in reverse: the latest documents are still on the device, the
    # ones before them in the host pool, the first ones in storage only.
    second = [stack.check(prompt(system, docs[d], 1, d)) for d in reversed(range(len(docs)))]
    replies += second
    assert sum(r.device for r in replies) > 0, "no device hit"
    assert sum(r.host for r in second) > 0, f"no host hit: {second}"
    assert sum(r.storage for r in second) > 0, f"no storage hit: {second}"
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{stack.cpcache.port}/metrics", timeout=30).read().decode()
    assert "hicache_host_total_tokens" in metrics, "SGLang's host-pool gauges are missing"
    hit = sum(r.cached for r in replies) / sum(len(prompt(system, d, 0, 0)) for d in docs * 2)
    print(f"hit rate {hit:.3f}; second pass device/host/storage tokens "
          f"{sum(r.device for r in second)}/{sum(r.host for r in second)}/{sum(r.storage for r in second)}")


# The flush and the abort run under the seed's shape in the suite (test_cp.py:
# prefill CP, Mooncake Store); at plain TP on files with CPCACHE_SGLANG_MORE=1.
@beyond_budget
def test_flush_cache_while_writes_are_queued_serves_no_wrong_bytes(stack: Stack):
    flush_with_writes_in_flight_serves_no_wrong_bytes(stack)


def test_a_weight_update_leaves_no_page_of_the_old_weights_reachable(stack: Stack):
    system, docs = workload(seed=6, docs=2)
    for d, doc in enumerate(docs):
        stack.check(prompt(system, doc, 0, d))
    updated = stack.cpcache.post("/update_weights_from_disk", {"model_path": str(stack.model)})
    assert updated.get("success"), updated
    for d, doc in enumerate(docs):
        got = stack.check(prompt(system, doc, 1, d))
        assert got.host == 0 and got.storage == 0, f"pages of the old weights were served: {got}"


def test_a_wrong_page_from_storage_breaks_the_match_negative_control(stack: Stack):
    a_wrong_stored_page_breaks_the_match(stack)


@beyond_budget
def test_requests_aborted_during_their_prefetch_are_revoked_on_every_rank(stack: Stack):
    requests_aborted_during_their_prefetch_are_revoked_on_every_rank(stack)


def test_a_daemon_killed_mid_run_leaves_the_server_serving_and_every_slot_comes_back(stack: Stack):
    # Seeds 13 to 17: none of them is a workload an earlier test of this
    # stack stored (the negative control's seed 4 left wrong pages in storage).
    kill_daemon_mid_run_and_come_back(stack, seed=13)
