"""The prefetch operation (cpcache/state/ops/prefetch.py), step by step on a
real CacheState of 4 host slots (2 where said) and two scripted ranks:

- a prefetch opens with a storage lookup; the hit is decided once every
  rank answered it (MIN), then fetched into slots of its own, or revoked
  (below the threshold, host pool full: eviction is all or nothing and
  spares the pages of the step that opened last);
- it asks nothing more until the scheduler polls it; a poll asks how many
  pages every rank fetched (MIN) and whether the policy lets it end
  (best_effort: at once; wait_complete: once every rank's fetch ended;
  timeout: complete or late everywhere); "not yet" needs a new poll;
- it ends accepted: its pages enter backed up, a page already resident
  keeping its copy (the pages after it still enter), and the slots it gave
  up retire until every rank is idle on them; or revoked by the scheduler, its slots retiring alike;
- a poll or revoke of a prefetch that ended lately is taken and ignored
  (the last 4096 are remembered), of an unknown one refused.
"""

from __future__ import annotations

import pytest

from cpcache.config import CacheConfig
from cpcache.errors import NotFound
from cpcache.requests import CacheRequests, PrefetchRequest, WriteRequest
from cpcache.state.intents import Decisions, Fetch, Lookup
from cpcache.state.ops.prefetch import ENDED_PREFETCHES_KEPT
from cpcache.state.questions import CopyOutcome
from tests.unit.state.scripted import SELECTIVE, SHARDING, ScriptedCache, page, pages

pytestmark = pytest.mark.timeout(10)

NOT_YET = -1


def prefetch(op_id: int, *ns: int, tokens: int = 48, parent: bytes | None = None) -> CacheRequests:
    return CacheRequests(prefetches=(PrefetchRequest(op_id, pages(*ns), tokens, parent),))


def poll(*op_ids: int) -> CacheRequests:
    return CacheRequests(prefetch_polls=op_ids)


def revoke(*op_ids: int) -> CacheRequests:
    return CacheRequests(revokes=op_ids)


def test_a_prefetch_polled_to_its_end_under_best_effort():
    c = ScriptedCache()
    s = c.step(prefetch(7, 1, 2, 3))
    assert s.intents == [Lookup(1, pages(1, 2, 3), SHARDING)]
    assert s.decided == Decisions()
    assert c.open_ops() == ["1: prefetch 7"] and c.ledger.by_op_id == {7: 1}
    assert s.digest == 0x74833c01164ab34
    opened = s.digest

    s = c.step()
    assert (s.answers, s.decided, s.digest) == ([(1, "prefetch hit", NOT_YET)], Decisions(), opened)

    c.answer("lookups", 1, 3, 2)
    s = c.step()
    assert s.answers == [(1, "prefetch hit", 2)]  # MIN: the pages every rank found
    assert s.decided == Decisions(prefetch_hits=[(7, 2)])
    assert s.intents == [Fetch(1, pages(1, 2), (0, 1), SHARDING)]
    assert c.pool() == ([2, 3], [0, 1], []) and c.slots() == {}
    assert s.digest == 0x2a21332e1a50588e
    decided = s.digest

    s = c.step()  # decided, not polled: nothing to ask
    assert (s.answers, s.decided, s.digest) == ([], Decisions(), decided)

    s = c.step(poll(7))
    assert (s.answers, s.decided) == ([], Decisions())  # the round was packed before the poll opened
    assert s.digest == 0x38c74b2f0224388

    c.answer("fetched_pages", 1, 2, 1)
    c.ranks[1].busy = {1}  # rank 1 is still fetching into slot 1
    s = c.step()
    assert s.answers == [(1, "prefetch done", 1), (1, "prefetch may end", 1)]
    assert s.decided == Decisions(prefetch_done=[(7, 1)], host_entered=[page(1)], host_entered_slots=[0])
    assert c.slots() == {page(1): 0}
    assert (c.entry(1).backed_up, c.entry(1).parent) == (True, None)  # it came from storage
    assert c.open_ops() == ["2: retirement 2"]  # slot 1, given up, waits for every rank
    assert c.pool() == ([2, 3], [0], [1])
    assert c.ledger.hit_pages == {"host": 0, "storage": 1}
    assert list(c.ledger.ended_prefetches) == [7] and c.ledger.by_op_id == {}
    assert s.digest == 0x14af0b70b37402a1

    s = c.step()
    assert (s.answers, s.decided, c.pool()) == ([(2, "reclaim", 0)], Decisions(), ([2, 3], [0], [1]))
    c.ranks[1].busy = set()
    s = c.step()
    assert s.answers == [(2, "reclaim", 1)]
    assert c.pool() == ([1, 2, 3], [0], []) and c.open_ops() == []
    assert c.ranks[0].forgotten == [1, 2]
    assert s.digest == 0x288f470e0a2c250f
    ended = s.digest

    s = c.step(poll(7))  # it ended: taken, and ignored
    assert (s.decided, s.digest) == (Decisions(), ended)
    s = c.step(revoke(7))
    assert (s.decided, s.digest) == (Decisions(), ended)
    with pytest.raises(NotFound, match=r"^prefetch 8 is not open$"):
        c.step(poll(8))
    assert c.digests == [  # the digest after every step
        0x74833c01164ab34, 0x74833c01164ab34, 0x2a21332e1a50588e, 0x2a21332e1a50588e, 0x38c74b2f0224388,
        0x14af0b70b37402a1, 0x14af0b70b37402a1, 0x288f470e0a2c250f, 0x288f470e0a2c250f, 0x288f470e0a2c250f,
        0x288f470e0a2c250f,
    ]


def test_a_hit_below_the_threshold_revokes_the_prefetch_and_one_at_it_is_fetched():
    c = ScriptedCache(CacheConfig(prefetch_threshold_tokens=48))  # 3 pages of 16 tokens
    c.step(CacheRequests(prefetches=(PrefetchRequest(7, pages(1, 2, 3), 48), PrefetchRequest(8, pages(4, 5, 6), 48))))
    c.answer("lookups", 1, 2)
    c.answer("lookups", 2, 3)
    s = c.step()
    assert s.answers == [(1, "prefetch hit", 2), (2, "prefetch hit", 3)]
    assert s.decided == Decisions(prefetch_hits=[(7, 2), (8, 3)],
                                  prefetch_revoked=[(7, "storage hit of 32 tokens is below the threshold")])
    assert s.intents == [Fetch(2, pages(4, 5, 6), (0, 1, 2), SHARDING)]
    assert c.open_ops() == ["2: prefetch 8"] and list(c.ledger.ended_prefetches) == [7]
    assert s.digest == 0x661d45708fe144c
    assert c.digests == [  # the digest after every step
        0x2310c1983956d839, 0x661d45708fe144c,
    ]


def test_a_hit_of_nothing_fetches_nothing_and_still_waits_for_a_poll():
    c = ScriptedCache()  # threshold 0: a hit of 0 tokens is not below it
    c.step(prefetch(7, 1, 2))
    c.answer("lookups", 1, 0, 2)
    s = c.step()
    assert s.decided == Decisions(prefetch_hits=[(7, 0)])
    assert s.intents == [Fetch(1, (), (), SHARDING)]
    assert c.open_ops() == ["1: prefetch 7"]
    s = c.step(poll(7))
    s = c.step()
    assert s.answers == [(1, "prefetch done", 0), (1, "prefetch may end", 1)]
    assert s.decided == Decisions(prefetch_done=[(7, 0)])
    assert c.open_ops() == [] and c.pool() == ([0, 1, 2, 3], [], [])
    assert s.digest == 0x25192229b11614b6
    assert c.digests == [  # the digest after every step
        0xd374dd7d0bbb2bb, 0x3c1a1ae41b902cbc, 0x305cd7a3e7f6a55e, 0x25192229b11614b6,
    ]


def test_a_hit_makes_room_all_or_nothing():
    c = ScriptedCache(SELECTIVE)
    c.write_and_ack(1, 1, 2, 3)  # a chain in slots 0 to 2, used at step 1
    c.step(prefetch(7, 4, 5))
    c.answer("lookups", 2, 2)
    s = c.step()
    assert s.decided == Decisions(prefetch_hits=[(7, 2)], host_left=[page(3)])  # the chain's leaf
    assert s.intents == [Fetch(2, pages(4, 5), (2, 3), SHARDING)]
    assert s.digest == 0x11317c1a82a07f7b

    c.step(prefetch(8, 6, 7, 8))
    c.answer("lookups", 3, 3)
    s = c.step()  # pages 1 and 2 free two slots: not enough, and nothing goes
    assert s.decided == Decisions(prefetch_hits=[(8, 3)], prefetch_revoked=[(8, "host pool full: 3 pages do not fit")])
    assert s.intents == []
    assert c.slots() == {page(1): 0, page(2): 1}
    assert c.pool() == ([], [0, 1, 2, 3], [])
    assert s.digest == 0xaa660cffa36cd16
    assert c.digests == [  # the digest after every step
        0x21a11d7ebb285226, 0x321845bb4227ddec, 0x3b844706316cba23, 0x11317c1a82a07f7b, 0x3ed78034ff2c3d06,
        0xaa660cffa36cd16,
    ]


def test_a_hit_decided_in_the_round_that_entered_a_page_does_not_evict_it():
    c = ScriptedCache(SELECTIVE, host_pages=2)
    c.step(CacheRequests(writes=(WriteRequest(1, pages(1), (0,)),)))
    c.answer("writes", 1, CopyOutcome.OK)
    s = c.step(prefetch(9, 5, 6))  # opens (serial 2), then write 1's ack enters page 1 at step 2
    assert s.decided == Decisions(write_acks=[1], host_entered=[page(1)], host_entered_slots=[0])
    c.answer("lookups", 2, 2)
    s = c.step()  # no step opened since: page 1 is the scheduler's news, it stays
    assert s.decided == Decisions(prefetch_hits=[(9, 2)], prefetch_revoked=[(9, "host pool full: 2 pages do not fit")])
    assert c.slots() == {page(1): 0}
    assert s.digest == 0x2bb837658f3725f4

    c.step(prefetch(10, 5, 6))  # step 4 opens: page 1 (step 2) may go now
    c.answer("lookups", 3, 2)
    s = c.step()
    assert s.decided == Decisions(prefetch_hits=[(10, 2)], host_left=[page(1)])
    assert s.intents == [Fetch(3, pages(5, 6), (0, 1), SHARDING)]
    assert s.digest == 0x1f40f7fdef88acb2
    assert c.digests == [  # the digest after every step
        0xcf293f8c57cfba3, 0xd5b7155e16b66cd, 0x2bb837658f3725f4, 0x3a0a47fd45e8374e, 0x1f40f7fdef88acb2,
    ]


def test_a_scheduler_revoke_retires_the_slots_until_every_rank_is_idle_on_them():
    c = ScriptedCache()
    c.step(prefetch(7, 1, 2))
    c.answer("lookups", 1, 2)
    s = c.step()
    assert s.intents == [Fetch(1, pages(1, 2), (0, 1), SHARDING)]
    c.ranks[0].busy = {0, 1}  # rank 0 is still fetching

    s = c.step(revoke(7))
    assert s.decided == Decisions(prefetch_revoked=[(7, "revoked by the scheduler")])  # told in the same step
    assert s.intents == []
    assert c.open_ops() == ["2: retirement 2"]
    assert c.pool() == ([2, 3], [], [0, 1])
    assert s.digest == 0x116c5558d9150f7

    s = c.step(CacheRequests(writes=(WriteRequest(8, pages(3, 4, 5), (0, 1, 2)),)))  # retiring slots are not room
    assert s.answers == [(2, "reclaim", 0)]
    assert s.decided == Decisions(write_failures=[8])
    assert s.digest == 0x306908e7c9918ebf

    c.ranks[0].busy = set()
    s = c.step()
    assert s.answers == [(2, "reclaim", 1)]
    assert c.pool() == ([0, 1, 2, 3], [], []) and c.open_ops() == []
    assert s.digest == 0x3cd7d2871d964d3e
    assert c.digests == [  # the digest after every step
        0xd374dd7d0bbb2bb, 0x1de6c1e56205a7f2, 0x116c5558d9150f7, 0x306908e7c9918ebf, 0x3cd7d2871d964d3e,
    ]


def test_a_revoke_before_the_hit_is_decided_ignores_the_late_answer():
    c = ScriptedCache()
    c.step(prefetch(7, 1, 2))
    c.answer("lookups", 1, 2)
    s = c.step(revoke(7))  # the revoke opens before the round's answers apply
    assert s.answers == [(1, "prefetch hit", 2)]
    assert s.decided == Decisions(prefetch_revoked=[(7, "revoked by the scheduler")])  # no hit: it had closed
    assert s.intents == [] and c.open_ops() == [] and c.pool() == ([0, 1, 2, 3], [], [])
    assert s.digest == 0x16c1885fc839c3c9
    assert c.digests == [  # the digest after every step
        0xd374dd7d0bbb2bb, 0x16c1885fc839c3c9,
    ]


def test_under_wait_complete_a_prefetch_ends_once_every_fetch_ended_and_not_yet_needs_a_new_poll():
    c = ScriptedCache(CacheConfig(prefetch_policy="wait_complete", prefetch_threshold_tokens=0))
    c.step(prefetch(7, 1, 2, 3))
    c.answer("lookups", 1, 3)
    s = c.step()
    assert s.intents == [Fetch(1, pages(1, 2, 3), (0, 1, 2), SHARDING)]
    c.step(poll(7))
    c.answer("fetched_pages", 1, 3, 2)
    c.ranks[0].fetches_ended.add(1)  # rank 1's fetch is still running
    s = c.step()
    assert s.answers == [(1, "prefetch done", 2), (1, "prefetch may end", 0)]
    assert s.decided == Decisions()
    assert s.digest == 0x2f6aa815b26655a6
    s = c.step()  # "not yet", asked after the latest poll: nothing is asked until the next poll
    assert s.answers == []

    s = c.step(poll(7))
    assert s.answers == []
    s = c.step(poll(7))  # polled again before the answer to the last poll
    assert s.answers == [(1, "prefetch done", 2), (1, "prefetch may end", 0)]
    assert s.digest == 0x12941e6f919d5813
    c.fetch_ends(1, 3, 2)  # rank 1's fetch ended after two pages: complete as far as it goes
    s = c.step()  # still asked: that "not yet" came in the round of the latest poll
    assert s.answers == [(1, "prefetch done", 2), (1, "prefetch may end", 1)]
    assert s.decided == Decisions(prefetch_done=[(7, 2)], host_entered=list(pages(1, 2)), host_entered_slots=[0, 1])
    assert c.pool() == ([3], [0, 1], [2])  # slot 2, fetched by rank 0 only, retires
    assert (c.entry(2).parent, c.entry(1).children) == (page(1), 1)
    assert s.digest == 0x3b28bd28df756b90
    assert c.digests == [  # the digest after every step
        0x74833c01164ab34, 0x1549e3b916482ba, 0x2f6aa815b26655a6, 0x2f6aa815b26655a6, 0x2f6aa815b26655a6,
        0x3591d7f9b433906e, 0x12941e6f919d5813, 0x3b28bd28df756b90,
    ]


def test_under_timeout_a_prefetch_ends_when_late_on_every_rank():
    c = ScriptedCache(CacheConfig(prefetch_policy="timeout", prefetch_threshold_tokens=0))
    assert c.ledger.config.prefetch_timeout_s(1024) == pytest.approx(2.1)
    c.step(prefetch(7, 1, 2, tokens=1024))
    c.answer("lookups", 1, 2)
    c.step()
    c.step(poll(7))
    c.answer("fetched_pages", 1, 1)
    c.answer("elapsed", 1, 2.0, 2.2)  # late on rank 1 only
    s = c.step()
    assert s.answers == [(1, "prefetch done", 1), (1, "prefetch may end", 0)]
    assert s.decided == Decisions()
    c.step(poll(7))
    c.answer("elapsed", 1, 2.2)
    s = c.step()
    assert s.answers == [(1, "prefetch done", 1), (1, "prefetch may end", 1)]
    assert s.decided == Decisions(prefetch_done=[(7, 1)], host_entered=[page(1)], host_entered_slots=[0])
    assert c.pool() == ([2, 3], [0], [1])
    assert s.digest == 0x14997c4d61685f48
    assert c.digests == [  # the digest after every step
        0xd374dd7d0bbb2bb, 0x1de6c1e56205a7f2, 0x16350109423268b5, 0x16350109423268b5, 0x1670706fb44439ec,
        0x14997c4d61685f48,
    ]


def test_a_poll_before_the_hit_is_decided_ends_the_prefetch_with_what_is_fetched_then():
    c = ScriptedCache()
    c.step(prefetch(7, 1, 2))
    s = c.step(poll(7))
    assert s.answers == [(1, "prefetch hit", NOT_YET)]
    c.answer("lookups", 1, 2)
    s = c.step()
    assert s.answers == [(1, "prefetch hit", 2)]  # the hit only: the poll is asked from the next round
    assert s.decided == Decisions(prefetch_hits=[(7, 2)])
    s = c.step()  # best_effort: it may end now, with nothing fetched yet
    assert s.answers == [(1, "prefetch done", 0), (1, "prefetch may end", 1)]
    assert s.decided == Decisions(prefetch_done=[(7, 0)])
    assert c.slots() == {} and c.pool() == ([2, 3], [], [0, 1])
    assert s.digest == 0x21514e519d6374d5
    assert c.digests == [  # the digest after every step
        0xd374dd7d0bbb2bb, 0x1b5585a4881542a9, 0x1a6ed3872866a597, 0x21514e519d6374d5,
    ]


def test_an_accepted_prefetch_keeps_a_page_already_resident_and_takes_the_pages_after_it():
    c = ScriptedCache(SELECTIVE)
    c.step(CacheRequests(prefetches=(PrefetchRequest(7, pages(1, 2, 3), 48),),
                         writes=(WriteRequest(8, pages(2), (0,)),)))  # serials 1 (prefetch) and 2 (write: slot 0)
    c.answer("lookups", 1, 3)
    c.answer("writes", 2, CopyOutcome.OK)
    s = c.step()
    assert s.decided == Decisions(prefetch_hits=[(7, 3)], write_acks=[8], host_entered=[page(2)],
                                  host_entered_slots=[0])
    assert s.intents == [Fetch(1, pages(1, 2, 3), (1, 2, 3), SHARDING)]
    c.step(poll(7))
    c.answer("fetched_pages", 1, 3)
    s = c.step()
    # Page 2 is resident already: its copy stays (its fetched slot 2 is given
    # up), and page 3 enters after it: all three pages are in the host pool.
    assert s.decided == Decisions(prefetch_done=[(7, 3)], host_entered=[page(1), page(3)],
                                  host_entered_slots=[1, 3])
    assert c.slots() == {page(1): 1, page(2): 0, page(3): 3}
    assert c.entry(3).parent == page(2) and c.entry(2).children == 1
    assert c.pool() == ([], [0, 1, 3], [2])
    assert c.ledger.hit_pages["storage"] == 2
    assert s.digest == 0x9f00491a29c3dd2
    assert c.digests == [  # the digest after every step
        0x21edc54a95df7084, 0x38f899496c160adb, 0x31d5e16374fcf57, 0x9f00491a29c3dd2,
    ]


def test_accepted_pages_hang_under_their_parent():
    c = ScriptedCache(SELECTIVE)
    c.write_and_ack(1, 1)
    c.step(prefetch(7, 2, 3, parent=page(1)))
    c.answer("lookups", 2, 2)
    c.step()
    c.step(poll(7))
    c.answer("fetched_pages", 2, 2)
    s = c.step()
    assert s.decided == Decisions(prefetch_done=[(7, 2)], host_entered=list(pages(2, 3)), host_entered_slots=[1, 2])
    assert [(c.entry(n).parent, c.entry(n).children) for n in (1, 2, 3)] == [(None, 1), (page(1), 1), (page(2), 0)]
    assert [c.entry(n).backed_up for n in (1, 2, 3)] == [False, True, True]
    assert s.digest == 0x3a3a6553f52da1de
    assert c.digests == [  # the digest after every step
        0xcf293f8c57cfba3, 0x258f2b48061b677a, 0x8070329c195ed28, 0x3ea9bcbf6eaa3e8, 0x2848120256fd93f9,
        0x3a3a6553f52da1de,
    ]


def test_only_the_latest_ended_prefetches_may_still_be_polled():
    c = ScriptedCache(host_pages=1)
    c.step(CacheRequests(prefetches=tuple(PrefetchRequest(i, pages(1), 16) for i in range(1, 4097))))
    c.step(prefetch(4097, 1))
    c.step(revoke(*range(1, 4097)))
    s = c.step(revoke(4097))
    assert s.decided == Decisions(prefetch_revoked=[(4097, "revoked by the scheduler")])
    ended = c.ledger.ended_prefetches
    assert len(ended) == ENDED_PREFETCHES_KEPT == 4096 and next(iter(ended)) == 2
    assert s.digest == 0x1359b6efa2531f20
    c.step(poll(2))
    with pytest.raises(NotFound, match=r"^prefetch 1 is not open$"):
        c.step(poll(1))
    assert c.digests == [  # the digest after every step
        0x38f874994b19f7a6, 0x229752ed321ffd3b, 0x9f098e34b24f6ba, 0x1359b6efa2531f20, 0x1359b6efa2531f20,
        0x1359b6efa2531f20,
    ]
