"""CacheState (cpcache/state/machine.py) as a whole, on a real state of 4
host slots (8 where said) and scripted ranks:

- `check` refuses a malformed or impossible step with the exact error, and
  a refused step changes nothing (digest, operations, pool);
- `open` opens a step's operations in a fixed order whatever the request
  lists first: loads, revokes, prefetches, polls, writes;
- `open_each` opens them one by one, each that cannot open failing on its
  own, and records the refusal;
- one round asks each open operation its own questions, in serial order;
  `stats`, `match` and `open_questions` read the state;
- the digest depends on the agreed values only, not on how many ranks
  agreed them or what each answered;
- at lag 1 a refused step opens nothing while the round due still applies.
"""

from __future__ import annotations

import pytest

from cpcache.config import CacheConfig
from cpcache.errors import InvalidArgument, NotFound
from cpcache.requests import CacheRequests, LoadRequest, PrefetchRequest, WriteRequest
from cpcache.state.intents import CopyToDevice, CopyToHost, Decisions, Fetch, Lookup
from cpcache.state.questions import CopyOutcome
from tests.unit.state.scripted import SELECTIVE, SHARDING, ScriptedCache, pages

pytestmark = pytest.mark.timeout(10)

OK, FAILED = CopyOutcome.OK, CopyOutcome.FAILED


def a_busy_state() -> ScriptedCache:
    """Page 1 resident in slot 0, write 5 open (serial 3, slot 1), prefetch 6 open (serial 2)."""
    c = ScriptedCache(SELECTIVE)
    c.write_and_ack(1, 1)
    c.step(CacheRequests(writes=(WriteRequest(5, pages(2), (1,)),), prefetches=(PrefetchRequest(6, pages(3), 16),)))
    assert c.ledger.by_op_id == {6: 2, 5: 3}
    return c


def W(op_id: int, ps: tuple[bytes, ...], device: tuple[int, ...], parent: bytes | None = None) -> CacheRequests:
    return CacheRequests(writes=(WriteRequest(op_id, ps, device, parent),))


REFUSALS = {
    "too many operations": (CacheRequests(revokes=tuple(range(4097))), InvalidArgument,
                            "a step carries at most 4096 operations, got 4097"),
    "no pages": (W(9, (), ()), InvalidArgument, "operation 9 has no pages"),
    "op id out of range": (W(2**63, pages(4), (0,)), InvalidArgument,
                           "operation id 9223372036854775808 is outside [0, 2**63)"),
    "short hash": (W(9, (b"x" * 31,), (0,)), InvalidArgument, "operation 9: page hashes are 32-byte sha256 digests"),
    "short parent": (W(9, pages(4), (0,), parent=b"x"), InvalidArgument,
                     "operation 9: parent must be a 32-byte page hash, got 1 bytes"),
    "a page twice": (W(9, pages(4, 5, 4), (0, 1, 2)), InvalidArgument,
                     "operation 9: a page appears twice: its pages are not a chain"),
    "its own parent": (W(9, pages(4, 5), (0, 1), parent=pages(5)[0]), InvalidArgument,
                       "operation 9: its parent is one of its pages: they are not a chain"),
    "device pages miscounted": (W(9, pages(4, 5), (0,)), InvalidArgument, "operation 9: 2 pages but 1 device pages"),
    "device page outside the pool": (W(9, pages(4), (16,)), InvalidArgument,
                                     "operation 9: device page 16 is outside the attached pool of 16 pages"),
    "op id twice in a step": (CacheRequests(writes=(WriteRequest(9, pages(4), (0,)),),
                                            loads=(LoadRequest(9, pages(1), (1,)),)),
                              InvalidArgument, "operation 9 appears twice in one step"),
    "negative tokens": (CacheRequests(prefetches=(PrefetchRequest(9, pages(4), -1),)), InvalidArgument,
                        "operation 9: tokens -1 is outside [0, 2**63)"),
    "too many pages": (CacheRequests(prefetches=(PrefetchRequest(9, pages(4) * (2**18 + 1), 16),)), InvalidArgument,
                       "operation 9 has 262145 pages, at most 262144"),
    "write id open": (W(5, pages(4), (0,)), InvalidArgument, "operation 5 is already open"),
    "load id open as a prefetch": (CacheRequests(loads=(LoadRequest(6, pages(1), (0,)),)), InvalidArgument,
                                   "operation 6 is already open"),
    "poll of nothing": (CacheRequests(prefetch_polls=(99,)), NotFound, "prefetch 99 is not open"),
    "poll of a write": (CacheRequests(prefetch_polls=(5,)), NotFound, "prefetch 5 is not open"),
    "poll and revoke": (CacheRequests(prefetch_polls=(6,), revokes=(6,)), InvalidArgument,
                        "prefetch 6 is polled or revoked twice in one step"),
    "negative revoke": (CacheRequests(revokes=(-1,)), InvalidArgument, "prefetch id -1 is outside [0, 2**63)"),
    "load not in host": (CacheRequests(loads=(LoadRequest(9, pages(1, 2), (0, 1)),)), NotFound,
                         "load 9: page 1 (0202020202020202) is not in host"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_step_raises_its_error_and_changes_nothing(case):
    requests, error, message = REFUSALS[case]
    c = a_busy_state()
    before = (c.digest, c.open_ops(), c.pool(), c.slots())
    assert c.digest == 0x3c33a2f55b27af5b
    with pytest.raises(error) as raised:
        c.state.check(requests)
    assert str(raised.value) == message
    with pytest.raises(error):
        c.step(requests)  # the round is rejected: nothing of the step opens
    assert (c.digest, c.open_ops(), c.pool(), c.slots()) == before
    assert c.digests == [  # the digest after every step
        0xcf293f8c57cfba3, 0x258f2b48061b677a, 0x3c33a2f55b27af5b, 0x3c33a2f55b27af5b,
    ]


def test_a_step_opens_loads_then_revokes_then_prefetches_then_polls_then_writes():
    c = ScriptedCache(SELECTIVE)
    c.write_and_ack(1, 1)
    c.step(CacheRequests(prefetches=(PrefetchRequest(2, pages(4), 16),)))  # serial 2
    s = c.step(CacheRequests(writes=(WriteRequest(3, pages(2), (5,)),),
                             prefetches=(PrefetchRequest(4, pages(3), 16),),
                             loads=(LoadRequest(5, pages(1), (6,)),),
                             revokes=(2,)))
    assert s.intents == [CopyToDevice(3, 5, (0,), (6,), 0), Lookup(4, pages(3), SHARDING), CopyToHost(5, (5,), (1,))]
    assert c.ledger.by_op_id == {5: 3, 4: 4, 3: 5}
    assert s.answers == [(2, "prefetch hit", -1)]  # asked before the revoke, answered about a closed prefetch
    assert s.decided == Decisions(prefetch_revoked=[(2, "revoked by the scheduler")])
    assert c.open_ops() == ["3: load 5", "4: prefetch 4", "5: write 3"]
    assert s.digest == 0x1f7fa2c468dcf075
    assert c.digests == [  # the digest after every step
        0xcf293f8c57cfba3, 0x258f2b48061b677a, 0x2075d49acd219803, 0x1f7fa2c468dcf075,
    ]


def test_open_each_fails_what_cannot_open_on_its_own():
    c = ScriptedCache(SELECTIVE, host_pages=2)
    c.write_and_ack(1, 1)  # page 1 in slot 0
    requests = CacheRequests(writes=(WriteRequest(8, pages(1, 2), (4, 5)),),
                             prefetches=(PrefetchRequest(7, pages(3), 16),),
                             loads=(LoadRequest(9, pages(4), (2,)), LoadRequest(10, pages(1), (3,))))
    before = c.digest
    with pytest.raises(NotFound):
        c.state.open(3, requests)
    assert c.digest == before
    intents, decided = c.state.open_each(3, requests)
    assert intents == [CopyToDevice(2, 10, (0,), (3,), 0), Lookup(3, pages(3), SHARDING), CopyToHost(4, (5,), (1,))]
    assert decided == Decisions(load_failures=[9])
    assert c.ledger.by_op_id == {10: 2, 7: 3, 8: 4}
    assert c.digest == 0x1813fc2453989d6c  # the refusal is recorded, with the operation refused
    assert c.digests == [  # the digest after every step
        0xcf293f8c57cfba3, 0x258f2b48061b677a,
    ]


def test_one_round_asks_every_open_operation_its_own_questions():
    c = ScriptedCache(CacheConfig(prefetch_threshold_tokens=0, prefetch_policy="wait_complete"), host_pages=8)
    c.state.carried_over([], [7])  # retirement 1: slot 7, still under rank 0's I/O
    c.ranks[0].busy = {7}
    c.write_and_ack(1, 1)  # write serial 2; its ack queues backup 3 (write_through)
    s = c.step(CacheRequests(prefetches=(PrefetchRequest(7, pages(3), 16), PrefetchRequest(8, pages(4, 5), 32)),
                             writes=(WriteRequest(9, pages(2), (1,)),), loads=(LoadRequest(10, pages(1), (2,)),)))
    assert c.ledger.by_op_id == {10: 4, 7: 5, 8: 6, 9: 7}
    c.answer("lookups", 6, 2)
    s = c.step()
    assert s.intents == [Fetch(6, pages(4, 5), (2, 3), SHARDING)]
    c.step(CacheRequests(prefetch_polls=(8,)))
    c.answer("fetched_pages", 6, 1)
    s = c.step()
    assert s.answers == [
        (1, "reclaim", 0),
        (3, "backup outcome", 0),
        (4, "load outcome", 0),
        (5, "prefetch hit", -1),
        (6, "prefetch done", 1),
        (6, "prefetch may end", 0),
        (7, "write outcome", 0),
    ]
    assert s.decided == Decisions()
    assert c.state.open_questions() == 6
    assert c.state.stats() == {
        "host_pages_used": 1,
        "host_pages_free": 3,
        "host_pages_retiring": 1,
        "open_prefetches": 2,
        "open_writes": 1,
        "open_backups": 1,
        "open_loads": 1,
        "host_hit_pages": 1,
        "storage_hit_pages": 0,
        "writes_refused_host_full": 0,
        "prefetch_held_pages": 0,
        "prefetch_holds_taken": 0,
        "prefetch_holds_expired": 0,
        "prefetched_pages_evicted_unloaded": 0,
        "host_pages_evicted": 0,
        "prefetch_asked_pages": 3,  # each prefetch's pages, counted as it opens
        "prefetch_resident_pages": 0,
        "prefetches_short": 0,
        "lost_hit_pages_host_evicted": 0,
        "lost_hit_pages_storage_miss": 0,  # prefetch 8's lookup found both pages; 7's has not answered
        "lost_hit_pages_below_threshold": 0,
        "lost_hit_pages_host_full": 0,
        "lost_hit_pages_revoked": 0,
    }
    assert (c.state.match(list(pages(1, 2))), c.state.match(list(pages(2, 1))), c.state.match([])) == (1, 0, 0)
    assert s.digest == 0x168430cdc3531cfe
    assert c.digests == [  # the digest after every step
        0x29cfa8052142fa04, 0x2819d14f415a93de, 0x1e44ccb9b5963838, 0x1211be943a8eb392, 0x168430cdc3531cfe,
        0x168430cdc3531cfe,
    ]


def test_the_digest_depends_on_the_agreed_values_only():
    def run(c: ScriptedCache, lookups: tuple[int, ...], outcomes: tuple[CopyOutcome, ...]) -> list[int]:
        digests = [c.step(CacheRequests(prefetches=(PrefetchRequest(7, pages(1, 2, 3), 48),),
                                        writes=(WriteRequest(8, pages(5), (0,)),))).digest]
        c.answer("lookups", 1, *lookups)
        c.answer("writes", 2, *outcomes)
        s = c.step()
        assert s.decided == Decisions(prefetch_hits=[(7, 2)], write_failures=[8])
        assert s.intents == [Fetch(1, pages(1, 2), (1, 2), SHARDING)]
        return [*digests, s.digest]

    one = run(ScriptedCache(ranks=1), (2,), (FAILED,))
    three = run(ScriptedCache(ranks=3), (3, 2, 5), (OK, FAILED, OK))
    assert one == three == [0x12a593187ee34edf, 0x123690b899cac85d]


def test_at_lag_one_a_refused_step_opens_nothing_and_the_round_due_still_applies():
    c = ScriptedCache(SELECTIVE, lag=1)
    s = c.step(CacheRequests(writes=(WriteRequest(1, pages(1), (0,)),)))
    assert (s.applied, s.intents, s.rejected) == (0, [], None)
    s = c.step(CacheRequests(writes=(WriteRequest(1, pages(2), (1,)),)))  # round 1 applies first: write 1 is open
    assert (s.applied, s.intents) == (1, [CopyToHost(1, (0,), (0,))])
    assert isinstance(s.rejected, InvalidArgument) and str(s.rejected) == "operation 1 is already open"
    opened = s.digest
    s = c.step()  # round 2, rejected: nothing of it applies
    assert (s.applied, s.answers, s.intents, s.decided, s.digest) == (2, [], [], Decisions(), opened)
    assert c.open_ops() == ["1: write 1"]
    assert c.digests == [  # the digest after every step
        0x0, 0xcf293f8c57cfba3, 0xcf293f8c57cfba3,
    ]
