"""Retirements (cpcache/state/ops/retirement.py): host slots given up while
some rank may still have I/O on them, and the evictions that make room.
Step by step on a real CacheState with two scripted ranks:

- a retired slot returns to the free list only once every rank reports it
  idle (MIN of RECLAIM); until then it is neither free nor allocatable,
  and each retirement is reclaimed on its own;
- evicting a page whose backup timed out somewhere (io_suspect) retires its
  slot instead of freeing it, so such a page makes no room: a pool of them
  refuses writes and prefetches and evicts nothing;
- a new epoch's carried-over state retires the slots still under some
  rank's I/O, and its kept pages are the least recently used of all.
"""

from __future__ import annotations

import pytest

from cpcache.config import CacheConfig
from cpcache.requests import CacheRequests, PrefetchRequest, WriteRequest
from cpcache.state.carryover import KeptPage, restore
from cpcache.state.intents import CopyToHost, Decisions, Fetch
from cpcache.state.questions import BackupOutcome
from tests.unit.state.scripted import SHARDING, ScriptedCache, page, pages

pytestmark = pytest.mark.timeout(10)

TIMED_OUT, STORED = BackupOutcome.TIMED_OUT, BackupOutcome.STORED


def test_each_retirement_is_reclaimed_once_every_rank_is_idle_on_its_slots():
    c = ScriptedCache()
    c.step(CacheRequests(prefetches=(PrefetchRequest(7, pages(1, 2), 32), PrefetchRequest(8, pages(3, 4), 32))))
    c.answer("lookups", 1, 2)
    c.answer("lookups", 2, 2)
    s = c.step()
    assert s.intents == [Fetch(1, pages(1, 2), (0, 1), SHARDING), Fetch(2, pages(3, 4), (2, 3), SHARDING)]
    c.ranks[0].busy = {1}
    c.ranks[1].busy = {2}
    s = c.step(CacheRequests(revokes=(7, 8)))
    assert c.open_ops() == ["3: retirement 3", "4: retirement 4"]
    assert c.pool() == ([], [], [0, 1, 2, 3])
    assert s.digest == 0x1a71288e1aac803

    s = c.step(CacheRequests(writes=(WriteRequest(9, pages(5), (0,)),)))  # no slot is free
    assert s.answers == [(3, "reclaim", 0), (4, "reclaim", 0)]
    assert s.decided == Decisions(write_failures=[9])

    c.ranks[1].busy = set()
    s = c.step()
    assert s.answers == [(3, "reclaim", 0), (4, "reclaim", 1)]
    assert c.open_ops() == ["3: retirement 3"] and c.pool() == ([2, 3], [], [0, 1])
    assert s.digest == 0x179d441bbd9b615f

    s = c.step(CacheRequests(writes=(WriteRequest(9, pages(5), (0,)),)))
    assert s.intents == [CopyToHost(5, (0,), (2,))]
    c.ranks[0].busy = set()
    s = c.step()
    assert s.answers == [(3, "reclaim", 1), (5, "write outcome", 0)]
    assert c.open_ops() == ["5: write 9"] and c.pool() == ([0, 1, 3], [2], [])
    assert s.digest == 0x2eb808de88653080
    assert c.digests == [  # the digest after every step
        0x169090632ada34fe, 0xd2775cac1c66aff, 0x1a71288e1aac803, 0x3d2ffc39b0ddc761, 0x179d441bbd9b615f,
        0x38fc33310d65c43f, 0x2eb808de88653080,
    ]


def test_pages_whose_backup_timed_out_make_no_room():
    c = ScriptedCache(host_pages=2)  # write_through
    c.write_and_ack(1, 1, 2)
    c.answer("backups", 2, TIMED_OUT, STORED)
    s = c.step()
    assert s.decided == Decisions(backups=[(2, False)])
    assert [c.entry(n).io_suspect for n in (1, 2)] == [True, True]
    assert s.digest == 0x3f3a17a81b174d0

    s = c.step(CacheRequests(writes=(WriteRequest(3, pages(3), (2,)),), prefetches=(PrefetchRequest(4, pages(5), 16),)))
    assert s.decided == Decisions(write_failures=[3])
    c.answer("lookups", 3, 1)
    s = c.step()
    assert s.decided == Decisions(prefetch_hits=[(4, 1)], prefetch_revoked=[(4, "host pool full: 1 pages do not fit")])
    assert c.slots() == {page(1): 0, page(2): 1}  # nothing was evicted
    assert c.pool() == ([], [0, 1], [])
    assert s.digest == 0x2baeda405b571840
    assert c.digests == [  # the digest after every step
        0x12ae73e5daf48f88, 0x3fa7dd73182770d3, 0x3f3a17a81b174d0, 0x16be0b01aedbf0f9, 0x2baeda405b571840,
    ]


def test_evicting_a_suspect_page_retires_its_slot_and_another_page_makes_the_room():
    c = ScriptedCache(host_pages=3)  # write_through
    c.write_and_ack(1, 1)  # write serial 1, backup serial 2
    c.answer("backups", 2, TIMED_OUT, STORED)
    c.step()
    c.ranks[0].busy = {0}  # rank 0's timed-out store may still be reading slot 0
    c.write_and_ack(3, 2)  # write serial 3, backup serial 4
    c.answer("backups", 4, STORED)
    s = c.step()
    assert s.decided == Decisions(backups=[(4, True)])
    assert [(c.entry(n).last_used, c.entry(n).io_suspect) for n in (1, 2)] == [(1, True), (4, False)]

    s = c.step(CacheRequests(writes=(WriteRequest(5, pages(3, 4), (0, 1)),)))  # one slot short
    # Page 1 (the least recently used) goes but frees nothing; page 2 goes too and frees slot 1.
    assert s.decided == Decisions(host_left=[page(1), page(2)])
    assert s.intents == [CopyToHost(6, (0, 1), (1, 2))]  # the retirement took serial 5 first
    assert c.open_ops() == ["5: retirement 5", "6: write 5"]
    assert c.pool() == ([], [1, 2], [0])
    assert s.digest == 0x979215d39b2611

    s = c.step()
    assert s.answers == [(5, "reclaim", 0), (6, "write outcome", 0)]
    c.ranks[0].busy = set()
    s = c.step()
    assert s.answers == [(5, "reclaim", 1), (6, "write outcome", 0)]
    assert c.pool() == ([0], [1, 2], [])
    assert s.digest == 0x187e0ff39c5b03a7
    assert c.digests == [  # the digest after every step
        0xcf293f8c57cfba3, 0x33f26e73b2f80cdd, 0x24b2312b8c43318e, 0x280fa98b770e0a20, 0x303e31be85362a90,
        0x833cb90ec501d6b, 0x979215d39b2611, 0x979215d39b2611, 0x187e0ff39c5b03a7,
    ]


def test_a_new_epoch_retires_the_busy_slots_and_its_kept_pages_go_first():
    c = ScriptedCache(CacheConfig(prefetch_threshold_tokens=0, write_policy="write_through_selective"))
    kept = [KeptPage(page(1), None, 2, True), KeptPage(page(2), page(1), 0, False)]
    restore(kept, c.ledger.index, c.ledger.allocator)
    c.state.carried_over(kept, [3])  # slot 3 is still under some rank's I/O
    assert c.open_ops() == ["1: retirement 1"]
    assert c.pool() == ([1], [0, 2], [3])
    assert [(c.entry(n).slot, c.entry(n).last_used, c.entry(n).backed_up) for n in (1, 2)] == [(2, 0, True),
                                                                                               (0, 0, False)]
    assert c.digest == 0x1ed013e8c3b72a83

    c.ranks[1].busy = {3}
    s = c.step(CacheRequests(writes=(WriteRequest(1, pages(5, 6), (0, 1)),)))
    assert s.intents == [CopyToHost(2, (0, 1), (0, 1))]  # page 2, the kept chain's leaf, makes the room
    # The first round tells the scheduler the kept pages, net of this eviction.
    assert s.decided == Decisions(host_entered=[page(1)], host_entered_slots=[2], host_left=[page(2)])
    assert s.digest == 0x299ef74abb6b1bfe
    c.ranks[1].busy = set()
    s = c.step()
    assert s.answers == [(1, "reclaim", 1), (2, "write outcome", 0)]
    assert c.pool() == ([3], [0, 1, 2], [])
    assert s.digest == 0x3a628b2cfab0f19c
    assert c.digests == [  # the digest after every step
        0x299ef74abb6b1bfe, 0x3a628b2cfab0f19c,
    ]


def test_a_new_epoch_with_nothing_kept_still_changes_the_digest():
    c = ScriptedCache()
    c.state.carried_over([], [])
    assert c.open_ops() == [] and c.pool() == ([0, 1, 2, 3], [], [])
    assert c.digest == 0x34aba3fa472d1508
