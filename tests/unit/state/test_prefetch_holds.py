"""Holds on ended prefetches' pages (cpcache/state/ops/prefetch_holds.py),
step by step on a real CacheState and two scripted ranks:

- a prefetch that asks to hold its pages keeps them from eviction once it
  ended: the write-throughs of other requests evict around them, until a
  step's `hold_releases` names it; then they are the least recently used
  again;
- without a hold, those writes evict the prefetched pages before any load
  read them, and `prefetched_pages_evicted_unloaded` counts them; a page a
  load read is not counted when it goes;
- holds take at most `prefetch_hold_share` of the pool's pages, a page two
  prefetches hold counted once: a prefetch ending at the cap holds what
  fits, from its first page;
- a hold the scheduler never releases ends after HOLD_STEPS steps, counted;
- a revoke that finds the prefetch ended releases its hold (the request
  is gone); an ended prefetch's id used again replaces its hold;
- a release of a prefetch that holds nothing (revoked, already released,
  unknown) is taken and ignored; one named twice in a step is refused.
"""

from __future__ import annotations

import pytest

from cpcache.config import CacheConfig
from cpcache.errors import InvalidArgument
from cpcache.requests import CacheRequests, LoadRequest, PrefetchRequest
from cpcache.state.intents import Decisions
from cpcache.state.ops import prefetch_holds
from cpcache.state.questions import CopyOutcome
from tests.unit.state.scripted import ScriptedCache, page, pages

pytestmark = pytest.mark.timeout(10)

# Backups only of pages loaded back twice: acks start no backup.
CONFIG = CacheConfig(prefetch_threshold_tokens=0, write_policy="write_through_selective")


def ended_prefetch(c: ScriptedCache, op_id: int, *ns: int, hold: bool = True) -> None:
    """Prefetch pages `ns`, found and fetched whole on every rank, then polled to its end."""
    c.step(CacheRequests(prefetches=(PrefetchRequest(op_id, pages(*ns), 16 * len(ns), None, hold),)))
    serial = c.ledger.by_op_id[op_id]
    c.answer("lookups", serial, len(ns))
    c.step()
    c.fetch_ends(serial, len(ns))
    c.step(CacheRequests(prefetch_polls=(op_id,)))
    s = c.step()
    assert s.decided.prefetch_done == [(op_id, len(ns))]


def release(*op_ids: int) -> CacheRequests:
    return CacheRequests(hold_releases=op_ids)


def stats(c: ScriptedCache) -> tuple[int, int, int]:
    s = c.state.stats()
    return s["prefetch_held_pages"], s["prefetch_holds_expired"], s["prefetched_pages_evicted_unloaded"]


def test_held_pages_outlive_the_writes_that_would_evict_them_until_released():
    c = ScriptedCache(CONFIG, host_pages=4)
    ended_prefetch(c, 7, 1, 2)
    assert stats(c) == (2, 0, 0)
    c.write_and_ack(8, 3, 4)  # the pool is full
    opened, _ = c.write_and_ack(9, 5, 6)
    assert opened.decided.host_left == [page(3), page(4)]  # not the prefetched pages, older as they are
    assert set(c.slots()) == set(pages(1, 2, 5, 6))

    s = c.step(release(7))
    assert s.decided == Decisions() and stats(c) == (0, 0, 0)
    opened, _ = c.write_and_ack(10, 3, 4)
    assert opened.decided.host_left == [page(1), page(2)]  # released: the least recently used
    assert stats(c) == (0, 0, 2)  # never loaded: two storage reads lost


def test_without_a_hold_the_writes_evict_the_prefetched_pages_first_and_count_them():
    c = ScriptedCache(CONFIG, host_pages=4)
    ended_prefetch(c, 7, 1, 2, hold=False)
    assert stats(c) == (0, 0, 0)
    c.write_and_ack(8, 3, 4)
    opened, _ = c.write_and_ack(9, 5, 6)
    assert opened.decided.host_left == [page(1), page(2)]
    assert stats(c) == (0, 0, 2)


def test_a_loaded_page_is_not_counted_when_evicted():
    c = ScriptedCache(CONFIG, host_pages=4)
    ended_prefetch(c, 7, 1, 2)
    c.step(CacheRequests(loads=(LoadRequest(11, pages(1), (3,)),), hold_releases=(7,)))
    c.answer("loads", c.ledger.by_op_id[11], CopyOutcome.OK)
    c.step()
    c.write_and_ack(8, 3, 4)
    opened, _ = c.write_and_ack(9, 5, 6)
    assert set(opened.decided.host_left) == set(pages(1, 2))
    assert stats(c) == (0, 0, 1)  # page 2 only: page 1 was loaded


def test_holds_take_at_most_their_share_of_the_pool_from_the_first_page():
    c = ScriptedCache(CacheConfig(prefetch_threshold_tokens=0, write_policy="write_through_selective",
                                  prefetch_hold_share=0.5), host_pages=8)
    ended_prefetch(c, 7, 1, 2, 3)
    ended_prefetch(c, 8, 11, 12, 13)  # the cap is 4 pages: page 11 only
    assert stats(c) == (4, 0, 0)
    assert [c.entry(n).held for n in (1, 2, 3, 11, 12, 13)] == [1, 1, 1, 1, 0, 0]
    c.write_and_ack(9, 21, 22)  # the pool is full
    opened, _ = c.write_and_ack(10, 31, 32)
    assert opened.decided.host_left == [page(12), page(13)]  # the unheld tail (told in hash order)
    assert page(11) in c.slots()

    c.step(release(7))
    ended_prefetch(c, 14, 41)  # room again under the cap; page 21 goes for it
    assert c.entry(41).held == 1 and stats(c)[0] == 2


def test_no_share_holds_nothing():
    c = ScriptedCache(CacheConfig(prefetch_threshold_tokens=0, prefetch_hold_share=0.0), host_pages=4)
    ended_prefetch(c, 7, 1, 2)
    assert stats(c) == (0, 0, 0) and c.ledger.holds == {}


def test_a_hold_never_released_ends_after_its_steps(monkeypatch):
    monkeypatch.setattr(prefetch_holds, "HOLD_STEPS", 3)
    c = ScriptedCache(CONFIG, host_pages=4)
    ended_prefetch(c, 7, 1, 2)  # ended in step 4's round, held at step 4
    held_at = c.ledger.holds[7].step
    while c.ledger.step < held_at + 2:
        c.step(release(99))  # steps that open something, releasing nothing
        assert stats(c) == (2, 0, 0)
    c.step(release(99))
    assert stats(c) == (0, 1, 0) and c.entry(1).held == 0


def test_a_release_of_a_prefetch_holding_nothing_is_ignored_and_one_named_twice_refused():
    c = ScriptedCache(CONFIG, host_pages=4)
    ended_prefetch(c, 7, 1, 2)
    before = c.digest
    s = c.step(release(5, 123456))  # never held, never known
    assert s.refused is None and c.digest == before and stats(c) == (2, 0, 0)
    with pytest.raises(InvalidArgument, match="released twice in one step"):
        c.step(release(7, 7))
    assert stats(c) == (2, 0, 0)
    c.step(release(7))
    s = c.step(release(7))  # again: nothing left to release
    assert s.refused is None and stats(c) == (0, 0, 0)


def test_a_page_two_prefetches_hold_counts_once_against_the_cap():
    c = ScriptedCache(CacheConfig(prefetch_threshold_tokens=0, write_policy="write_through_selective",
                                  prefetch_hold_share=0.5), host_pages=8)
    ended_prefetch(c, 7, 1, 2, 3)
    ended_prefetch(c, 8, 1, 2, 3)  # the same prefix, another request: costs nothing more
    ended_prefetch(c, 9, 11)
    assert stats(c)[0] == 4 and [c.entry(n).held for n in (1, 2, 3, 11)] == [2, 2, 2, 1]
    c.step(release(7))
    assert stats(c)[0] == 4 and c.entry(1).held == 1
    c.step(release(8))
    assert stats(c)[0] == 1 and c.entry(1).held == 0


def test_a_revoke_finding_the_prefetch_ended_releases_its_hold():
    c = ScriptedCache(CONFIG, host_pages=4)
    ended_prefetch(c, 7, 1, 2)
    s = c.step(CacheRequests(revokes=(7,)))
    assert s.decided == Decisions() and stats(c) == (0, 0, 0)


def test_an_ended_prefetchs_id_used_again_replaces_its_hold():
    c = ScriptedCache(CONFIG, host_pages=4)
    ended_prefetch(c, 7, 1, 2)
    ended_prefetch(c, 7, 3)
    assert stats(c)[0] == 1 and [c.entry(n).held for n in (1, 2, 3)] == [0, 0, 1]
    c.step(release(7))
    assert stats(c)[0] == 0 and c.entry(3).held == 0
