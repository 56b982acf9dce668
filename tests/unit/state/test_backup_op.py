"""The backup operation (host -> storage, cpcache/state/ops/backup.py), step by
step on a real CacheState of 4 host slots (2 where said) and two scripted
ranks, under each write policy:

- write_through backs up the pages an acknowledged write entered; the
  backup holds its pages (no eviction) until every rank's store ended;
  the agreed outcome is the worst one (MIN): stored, failed, or timed out
  (the pages turn io_suspect: a store may still be reading them);
- only the first `backup_window` open backups are asked about each round;
- write_through_selective backs up a page when it is loaded back a second
  time, and then never again;
- write_back backs nothing up after an ack; a page may be evicted only once
  backed up, and when free slots run under the low-water mark the least
  recently used unreferenced pages not backed up are, one round at a time.
"""

from __future__ import annotations

import pytest

from cpcache.config import CacheConfig
from cpcache.requests import CacheRequests, LoadRequest, WriteRequest
from cpcache.state.intents import CopyToDevice, CopyToHost, Decisions, Store
from cpcache.state.questions import BackupOutcome, CopyOutcome
from tests.unit.state.scripted import SHARDING, ScriptedCache, page, pages

pytestmark = pytest.mark.timeout(10)

PENDING, TIMED_OUT, FAILED, STORED = (BackupOutcome.PENDING, BackupOutcome.TIMED_OUT, BackupOutcome.FAILED,
                                      BackupOutcome.STORED)
OK = CopyOutcome.OK


def test_write_through_backs_up_an_acknowledged_write_and_holds_its_pages_until_stored():
    c = ScriptedCache(host_pages=2)  # write_through, the default
    _, acked = c.write_and_ack(1, 1, 2)
    assert acked.decided == Decisions(write_acks=[1], host_entered=list(pages(1, 2)), host_entered_slots=[0, 1])
    assert acked.intents == [Store(2, pages(1, 2), (0, 1), SHARDING)]
    assert c.state.daemon_open() == 1  # the scheduler steps until it is decided
    store = acked.intents[0]
    assert (store.keys, store.slots) == ((page(1).hex() + "_tp0_1", page(2).hex() + "_tp0_1"), (0, 1))  # one rank: all
    assert c.open_ops() == ["2: backup 2"]
    assert [(c.entry(n).refs, c.entry(n).backed_up) for n in (1, 2)] == [(1, False), (1, False)]
    assert c.state.stats()["open_backups"] == 1
    assert acked.digest == 0x3fa7dd73182770d3

    s = c.step(CacheRequests(writes=(WriteRequest(2, pages(3), (2,)),)))  # both pages are held: no room
    assert s.answers == [(2, "backup outcome", PENDING)]
    assert (s.intents, s.decided) == ([], Decisions(write_failures=[2]))
    assert s.digest == 0x1ea8bfde0cdfba4c

    c.answer("backups", 2, STORED, PENDING)
    s = c.step()
    assert (s.answers, s.decided) == ([(2, "backup outcome", PENDING)], Decisions())
    c.answer("backups", 2, STORED)
    s = c.step()
    assert s.answers == [(2, "backup outcome", STORED)]
    assert s.decided == Decisions(backups=[(2, True)])
    assert s.decided.backup_pages == [pages(1, 2)]  # the reply names what the backup wrote
    assert [(c.entry(n).refs, c.entry(n).backed_up, c.entry(n).io_suspect) for n in (1, 2)] == [(0, True, False)] * 2
    assert c.open_ops() == [] and c.ranks[0].forgotten == [1, 2]
    assert s.digest == 0x1a5f63e5921a5cc0

    s = c.step(CacheRequests(writes=(WriteRequest(2, pages(3), (2,)),)))  # released: the leaf goes
    assert (s.intents, s.decided) == ([CopyToHost(3, (2,), (1,))], Decisions(host_left=[page(2)]))
    assert s.digest == 0x1820c8df8f2e5a3a
    assert c.digests == [  # the digest after every step
        0x12ae73e5daf48f88, 0x3fa7dd73182770d3, 0x1ea8bfde0cdfba4c, 0x1ea8bfde0cdfba4c, 0x1a5f63e5921a5cc0,
        0x1820c8df8f2e5a3a,
    ]


@pytest.mark.parametrize(("outcomes", "agreed", "suspect", "digest"), [
    ((STORED, FAILED), FAILED, False, 0x2390970de6be1728),
    ((TIMED_OUT, STORED), TIMED_OUT, True, 0x3f3a17a81b174d0),
    ((FAILED, TIMED_OUT), TIMED_OUT, True, 0x3f3a17a81b174d0),  # the worst: a store that may still be reading the pages
])
def test_the_agreed_backup_outcome_is_the_worst_rank_s(outcomes, agreed, suspect, digest):
    c = ScriptedCache()
    c.write_and_ack(1, 1, 2)
    c.answer("backups", 2, *outcomes)
    s = c.step()
    assert s.answers == [(2, "backup outcome", agreed)]
    assert s.decided == Decisions(backups=[(2, False)])
    assert s.decided.backup_pages == [pages(1, 2)]
    assert [(c.entry(n).refs, c.entry(n).backed_up, c.entry(n).io_suspect) for n in (1, 2)] == [(0, False, suspect)] * 2
    assert s.digest == digest
    assert c.digests == [0x12ae73e5daf48f88, 0x3fa7dd73182770d3, digest]  # the digest after every step


def test_only_the_first_backups_of_the_window_are_asked_about():
    c = ScriptedCache(CacheConfig(prefetch_threshold_tokens=0, backup_window=1))
    c.step(CacheRequests(writes=(WriteRequest(1, pages(1), (0,)), WriteRequest(2, pages(2), (1,)))))
    c.answer("writes", 1, OK)
    c.answer("writes", 2, OK)
    s = c.step()
    assert s.intents == [Store(3, pages(1), (0,), SHARDING), Store(4, pages(2), (1,), SHARDING)]  # both start
    c.answer("backups", 4, STORED)
    s = c.step()
    assert s.answers == [(3, "backup outcome", PENDING)]  # backup 4 is stored, but not asked about yet
    c.answer("backups", 3, STORED)
    s = c.step()
    assert (s.answers, s.decided) == ([(3, "backup outcome", STORED)], Decisions(backups=[(3, True)]))
    s = c.step()
    assert (s.answers, s.decided) == ([(4, "backup outcome", STORED)], Decisions(backups=[(4, True)]))
    assert s.digest == 0x1e24eabcbed200de
    assert c.digests == [  # the digest after every step
        0x16d9bd83776ad1e, 0x159ad9b53311a7ba, 0x159ad9b53311a7ba, 0x4ad5228c49504b6, 0x1e24eabcbed200de,
    ]


def test_write_through_selective_backs_up_a_page_at_its_second_load_only():
    c = ScriptedCache(CacheConfig(prefetch_threshold_tokens=0, write_policy="write_through_selective"))
    _, acked = c.write_and_ack(1, 1, 2)
    assert acked.intents == []  # nothing after an ack
    s = c.step(CacheRequests(loads=(LoadRequest(2, pages(1, 2), (0, 1)),)))
    assert s.intents == [CopyToDevice(2, 2, (0, 1), (0, 1), 0)]
    c.answer("loads", 2, OK)
    c.step()
    s = c.step(CacheRequests(loads=(LoadRequest(3, pages(1), (0,)),)))
    assert s.intents == [CopyToDevice(3, 3, (0,), (0,), 0), Store(4, pages(1), (0,), SHARDING)]
    assert [c.entry(n).hits for n in (1, 2)] == [2, 1]
    assert s.digest == 0x379d2baec0ae638f
    c.answer("loads", 3, OK)
    c.answer("backups", 4, FAILED)
    s = c.step()
    assert s.decided == Decisions(loads=[(3, 1)], backups=[(4, False)])
    assert s.decided.backup_pages == [pages(1)]  # the hot page alone
    s = c.step(CacheRequests(loads=(LoadRequest(5, pages(1, 2), (0, 1)),)))  # page 2's second load, page 1's third
    assert s.intents == [CopyToDevice(5, 5, (0, 1), (0, 1), 0), Store(6, pages(2), (1,), SHARDING)]
    assert [(c.entry(n).hits, c.entry(n).backed_up) for n in (1, 2)] == [(3, False), (2, False)]
    assert s.digest == 0x59428af5e968a80
    assert c.digests == [  # the digest after every step
        0x12ae73e5daf48f88, 0x2d06e8787f9c8717, 0x36783d386351c188, 0x22ddf8eb43e3128e, 0x379d2baec0ae638f,
        0x3a51dd012dd1ffbe, 0x59428af5e968a80,
    ]


def test_write_back_evicts_backed_up_pages_only_and_backs_pages_up_under_pressure():
    c = ScriptedCache(CacheConfig(prefetch_threshold_tokens=0, write_policy="write_back"))
    assert max(1, c.ledger.allocator.pages // 8) == 1  # the low-water mark: back up once no slot is free
    _, acked = c.write_and_ack(1, 1, 2, 3)
    assert acked.intents == []  # no backup after an ack
    assert c.pool() == ([3], [0, 1, 2], [])

    s = c.step(CacheRequests(writes=(WriteRequest(2, pages(4), (3,)),)))  # the last free slot
    # The least recently used page not backed up, leaf or not: page 1 (step 1, lowest hash).
    assert s.intents == [CopyToHost(2, (3,), (3,)), Store(3, pages(1), (0,), SHARDING)]
    assert s.digest == 0x1940d671b294e49d
    c.answer("writes", 2, OK)
    s = c.step()
    assert s.decided == Decisions(write_acks=[2], host_entered=[page(4)], host_entered_slots=[3])
    assert s.intents == [Store(4, pages(2), (1,), SHARDING)]  # still no free slot: one more a round
    assert c.open_ops() == ["3: backup 3", "4: backup 4"]
    assert c.state.daemon_open() == 0  # to make room: no scheduler steps for them (queued again if they fail)
    assert s.digest == 0x1cde0864ee521a93

    c.answer("backups", 3, STORED)
    c.answer("backups", 4, STORED)
    s = c.step()
    assert s.decided == Decisions(backups=[(3, True), (4, True)])
    assert s.intents == [Store(5, pages(3), (2,), SHARDING)]
    assert [c.entry(n).backed_up for n in (1, 2, 3, 4)] == [True, True, False, False]

    s = c.step(CacheRequests(writes=(WriteRequest(5, pages(5), (4,)),)))
    # Pages 1 and 2 are backed up but not leaves; leaves 3 and 4 are not backed up: nothing may go.
    assert s.decided == Decisions(write_failures=[5])
    assert s.intents == [Store(6, pages(4), (3,), SHARDING)]
    assert c.state.stats()["writes_refused_host_full"] == 1
    assert s.digest == 0x81593ebbfbbf59c

    c.answer("backups", 5, STORED)
    s = c.step()
    assert (s.decided, s.intents) == (Decisions(backups=[(5, True)]), [])  # page 4's backup is in flight already
    s = c.step(CacheRequests(writes=(WriteRequest(5, pages(5), (4,)),)))  # page 3, backed up, is a leaf
    assert s.intents == [CopyToHost(7, (4,), (2,))]
    assert s.decided == Decisions(host_left=[page(3)])
    assert s.digest == 0x39306d1ab20a52dc
    assert c.digests == [  # the digest after every step
        0x21a11d7ebb285226, 0x321845bb4227ddec, 0x1940d671b294e49d, 0x1cde0864ee521a93, 0x73ba1296971f40f,
        0x81593ebbfbbf59c, 0x30b335ae81150d4f, 0x39306d1ab20a52dc,
    ]
