"""Where the pages prefetches ask for go (cpcache/state/ops/prefetch.py,
docs/operations.md "Why a hit was lost"), on a real CacheState and two
scripted ranks: every page asked ends as a storage hit, a page found
resident, or lost for one reason, and the reasons add up to what was asked;
and best_effort gives a read under way its bounded wait before it ends.
"""

from __future__ import annotations

import pytest

from cpcache.config import CacheConfig
from cpcache.requests import CacheRequests, PrefetchRequest
from cpcache.state.intents import Decisions
from tests.unit.state.scripted import ScriptedCache, pages

pytestmark = pytest.mark.timeout(10)

ADDED = ("storage_hit_pages", "prefetch_resident_pages", "lost_hit_pages_storage_miss",
         "lost_hit_pages_below_threshold", "lost_hit_pages_host_full", "lost_hit_pages_revoked")


def prefetch(op_id: int, *ns: int) -> CacheRequests:
    return CacheRequests(prefetches=(PrefetchRequest(op_id, pages(*ns), 16 * len(ns)),))


def counters(c: ScriptedCache) -> dict[str, int]:
    """State's counters with each rank's split of the short prefetches (rank 0's, then rank 1's)."""
    stats = c.state.stats()
    for r, runtime in enumerate(c.runtimes):
        for reason, n in runtime.short_reads.items():
            stats[f"lost_hit_pages_{reason}@{r}"] = n
    return stats


def added_up(stats: dict[str, int], rank: int) -> int:
    return sum(stats[k] for k in ADDED) + sum(stats[f"lost_hit_pages_{k}@{rank}"] for k in ("prefetch_late",
                                                                                           "read_failed"))


def test_every_page_asked_ends_in_one_place_and_the_places_add_up_to_what_was_asked():
    c = ScriptedCache(CacheConfig(prefetch_threshold_tokens=32, prefetch_best_effort_wait_s=0.0), host_pages=4)
    # 7: 3 pages asked, 1 in storage: a miss of 2, and a hit of 16 tokens below the threshold.
    # 8: 4 asked, 3 found on both ranks (4 on one): a miss of 1; fetched 3 on rank 0, 1 on rank 1 then polled:
    #    1 accepted, 2 ended short, which rank 0 counts as a failed read (its read of page 6 failed).
    #    (The scripted ranks share one state: rank 0's runtime applies each round, and splits.)
    c.step(CacheRequests(prefetches=(PrefetchRequest(7, pages(1, 2, 3), 48),
                                     PrefetchRequest(8, pages(4, 5, 6, 7), 64))))
    c.answer("lookups", 1, 1)
    c.answer("lookups", 2, 4, 3)
    s = c.step()
    assert s.decided.prefetch_revoked == [(7, "storage hit of 16 tokens is below the threshold")]
    c.step(CacheRequests(prefetch_polls=(8,)))
    c.answer("fetched_pages", 2, 3, 1)
    c.ranks[0].reads_failed.add(2)
    s = c.step()
    assert s.decided.prefetch_done == [(8, 1)]
    # 9: 5 pages, all in storage, but 3 free slots and 1 page held by nobody: the pool cannot take 5.
    c.step(prefetch(9, 8, 9, 10, 11, 12))
    c.answer("lookups", c.ledger.by_op_id[9], 5)
    s = c.step()
    assert s.decided.prefetch_revoked == [(9, "host pool full: 5 pages do not fit")]
    # 10: revoked by the scheduler before its lookup answered: every page it asked for.
    c.step(prefetch(10, 13, 14))
    s = c.step(CacheRequests(revokes=(10,)))
    assert s.decided.prefetch_revoked == [(10, "revoked by the scheduler")]
    stats = counters(c)
    assert {k: stats[k] for k in ("prefetch_asked_pages", *ADDED, "prefetches_short")} == {
        "prefetch_asked_pages": 14, "storage_hit_pages": 1, "prefetch_resident_pages": 0,
        "lost_hit_pages_storage_miss": 3, "lost_hit_pages_below_threshold": 1, "lost_hit_pages_host_full": 5,
        "lost_hit_pages_revoked": 2, "prefetches_short": 1}
    assert (stats["lost_hit_pages_prefetch_late@0"], stats["lost_hit_pages_read_failed@0"]) == (0, 2)
    assert added_up(stats, 0) == stats["prefetch_asked_pages"]


def test_best_effort_waits_its_bound_for_a_read_under_way_and_not_for_one_done():
    c = ScriptedCache(CacheConfig(prefetch_threshold_tokens=0, prefetch_best_effort_wait_s=0.05))
    c.step(prefetch(7, 1, 2))
    c.answer("lookups", 1, 2)
    c.step()
    c.step(CacheRequests(prefetch_polls=(7,)))
    c.answer("elapsed", 1, 0.01)
    s = c.step()  # under way on both ranks, 10 ms in: not yet
    assert s.answers == [(1, "prefetch done", 0), (1, "prefetch may end", 0)]
    assert s.decided == Decisions()
    c.step(CacheRequests(prefetch_polls=(7,)))
    c.answer("elapsed", 1, 0.01, 0.06)  # past the bound on rank 1 only: MIN says not yet
    assert c.step().answers == [(1, "prefetch done", 0), (1, "prefetch may end", 0)]
    c.step(CacheRequests(prefetch_polls=(7,)))
    c.fetch_ends(1, 2)  # every read done: it ends, whatever the time
    s = c.step()
    assert s.decided.prefetch_done == [(7, 2)]
    assert counters(c)["prefetches_short"] == 0
    # A read past the bound ends short, its rest late.
    c.step(prefetch(8, 3, 4))
    serial = c.ledger.by_op_id[8]
    c.answer("lookups", serial, 2)
    c.step()
    c.step(CacheRequests(prefetch_polls=(8,)))
    c.answer("elapsed", serial, 0.05)
    c.answer("fetched_pages", serial, 1)
    assert c.step().decided.prefetch_done == [(8, 1)]
    stats = counters(c)
    assert (stats["prefetches_short"], stats["lost_hit_pages_prefetch_late@0"]) == (1, 1)
