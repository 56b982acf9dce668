"""The write-through operation (cpcache/state/ops/write.py), step by step on a
real CacheState of 4 host slots (2 where said) and two scripted ranks:

- a write gets host slots for the pages not yet resident when it opens and
  enters them once every rank's copy ended well (MIN of the outcomes), the
  agreed "pending" changing nothing meanwhile;
- a copy that failed on one rank fails the write, once every rank ended,
  and its slots are free at once;
- a full pool refuses a write in the step that opens it, and a write makes
  room by evicting unreferenced leaves, least recently used first (ties by
  hash), all or nothing, never a page the step itself uses;
- a write of pages already present copies only the others and touches the
  resident ones; two copies of one page enter once, the later copy's slot
  freed.

Most tests use write_through_selective, whose acks queue no backup (the
backups that write_through queues after an ack are test_backup_op.py's).
"""

from __future__ import annotations

import pytest

from cpcache.requests import CacheRequests, LoadRequest, WriteRequest
from cpcache.state.intents import CopyToDevice, CopyToHost, Decisions, Store
from cpcache.state.questions import BackupOutcome
from tests.unit.state.scripted import FAILED, OK, PENDING, SELECTIVE, SHARDING, ScriptedCache, page, pages

pytestmark = pytest.mark.timeout(10)



def writes(*reqs: WriteRequest) -> CacheRequests:
    return CacheRequests(writes=reqs)


def test_a_write_enters_its_pages_once_every_rank_copied_them():
    c = ScriptedCache(SELECTIVE)
    s = c.step(writes(WriteRequest(7, pages(1, 2), (5, 6))))
    assert s.answers == []  # asked from the next round on
    assert s.intents == [CopyToHost(1, (5, 6), (0, 1))]  # serial 1, the lowest free slots
    assert s.decided == Decisions()
    assert c.open_ops() == ["1: write 7"] and c.ledger.by_op_id == {7: 1}
    assert c.slots() == {}  # not resident until acknowledged
    assert c.pool() == ([2, 3], [0, 1], [])
    assert s.digest == 0x31cda1db28126d1b
    opened = s.digest

    s = c.step()
    assert s.answers == [(1, "write outcome", PENDING)]
    assert (s.intents, s.decided, s.digest) == ([], Decisions(), opened)  # waiting changes nothing

    c.answer("writes", 1, OK, PENDING)
    s = c.step()
    assert s.answers == [(1, "write outcome", PENDING)]  # MIN: rank 1 is still copying
    assert (s.decided, s.digest, c.open_ops()) == (Decisions(), opened, ["1: write 7"])

    c.answer("writes", 1, OK)
    s = c.step()
    assert s.answers == [(1, "write outcome", OK)]
    assert s.decided == Decisions(write_acks=[7], host_entered=[page(1), page(2)], host_entered_slots=[0, 1])
    assert s.intents == []  # write_through_selective: no backup after an ack
    assert c.slots() == {page(1): 0, page(2): 1}
    assert (c.entry(1).parent, c.entry(1).children, c.entry(2).parent, c.entry(2).children) == (None, 1, page(1), 0)
    assert c.entry(1).last_used == c.entry(2).last_used == 1  # the step whose operations opened last
    assert c.open_ops() == [] and c.ledger.by_op_id == {}
    assert c.ranks[0].forgotten == [1]  # the data plane forgets the closed serial
    assert c.pool() == ([2, 3], [0, 1], [])
    assert s.digest == 0x15405551fd971f89
    assert c.digests == [  # the digest after every step
        0x31cda1db28126d1b, 0x31cda1db28126d1b, 0x31cda1db28126d1b, 0x15405551fd971f89,
    ]


def test_a_copy_that_failed_on_one_rank_fails_the_write_once_every_rank_ended_and_frees_its_slots():
    c = ScriptedCache(SELECTIVE)
    opened = c.step(writes(WriteRequest(7, pages(1, 2), (5, 6)))).digest
    assert opened == 0x31cda1db28126d1b

    c.answer("writes", 1, PENDING, FAILED)
    s = c.step()
    assert s.answers == [(1, "write outcome", PENDING)]  # rank 0 may still be copying into the slots
    assert (s.decided, s.digest, c.pool()) == (Decisions(), opened, ([2, 3], [0, 1], []))

    c.answer("writes", 1, OK, FAILED)
    s = c.step()
    assert s.answers == [(1, "write outcome", FAILED)]
    assert s.decided == Decisions(write_failures=[7])
    assert c.slots() == {} and c.open_ops() == [] and c.ledger.by_op_id == {}
    assert c.pool() == ([0, 1, 2, 3], [], [])  # free at once: every rank's copy has ended
    assert s.digest == 0x2a3b539ec34048e8

    s = c.step(writes(WriteRequest(7, pages(1, 2), (5, 6))))  # the same op id, again: a new serial, the same slots
    assert s.intents == [CopyToHost(2, (5, 6), (0, 1))]
    assert s.digest == 0x130a0e5bf0a3ce67
    assert c.digests == [  # the digest after every step
        0x31cda1db28126d1b, 0x31cda1db28126d1b, 0x2a3b539ec34048e8, 0x130a0e5bf0a3ce67,
    ]


def test_a_full_pool_refuses_a_write_in_the_step_that_opens_it():
    c = ScriptedCache(SELECTIVE, host_pages=2)
    s = c.step(writes(WriteRequest(7, pages(1, 2), (0, 1))))
    assert s.intents == [CopyToHost(1, (0, 1), (0, 1))] and s.digest == 0x31cda1db28126d1b

    s = c.step(writes(WriteRequest(8, pages(3), (2,))))  # write 7's slots are not evictable: not resident yet
    assert s.intents == []
    assert s.decided == Decisions(write_failures=[8])  # not a scheduler error: the step itself answers it
    assert c.open_ops() == ["1: write 7"] and c.ledger.by_op_id == {7: 1}
    assert c.state.stats()["writes_refused_host_full"] == 1
    assert c.pool() == ([], [0, 1], [])
    assert s.digest == 0x3727d09d214e4f75

    c.answer("writes", 1, OK)
    s = c.step()
    assert s.decided == Decisions(write_acks=[7], host_entered=[page(1), page(2)], host_entered_slots=[0, 1])
    assert s.digest == 0x2c7192e5b42fb4c9

    s = c.step(writes(WriteRequest(8, pages(3), (2,))))  # now the leaf page 2 can go: it takes its slot
    assert s.intents == [CopyToHost(2, (2,), (1,))]  # serial 2: a refused write took none
    assert s.decided == Decisions(host_left=[page(2)])
    assert c.slots() == {page(1): 0} and c.entry(1).children == 0
    assert s.digest == 0x3e6f0ec088e97c41
    assert c.digests == [  # the digest after every step
        0x31cda1db28126d1b, 0x3727d09d214e4f75, 0x2c7192e5b42fb4c9, 0x3e6f0ec088e97c41,
    ]


def test_a_write_makes_room_by_evicting_the_least_recently_used_page_ties_broken_by_hash():
    c = ScriptedCache(SELECTIVE)
    digests = []
    for n in (1, 2, 3, 4):  # one page a step; each step's apply acknowledges the write of the step before
        c.answer("writes", n - 1, OK)
        s = c.step(writes(WriteRequest(n, pages(n), (n,))))
        assert s.intents == [CopyToHost(n, (n,), (n - 1,))]
        assert s.decided == (Decisions() if n == 1 else
                             Decisions(write_acks=[n - 1], host_entered=[page(n - 1)], host_entered_slots=[n - 2]))
        digests.append(s.digest)
    assert digests == [0xcf293f8c57cfba3, 0x1ca46b93381e4c5e, 0x3686eb955159782, 0x47233f6ee77bbcd]
    assert [c.entry(n).last_used for n in (1, 2, 3)] == [2, 3, 4]  # entered in the step after each write opened

    c.answer("writes", 4, OK)
    s = c.step(CacheRequests(loads=(LoadRequest(5, pages(1), (9,)),)))  # page 1 used again at step 5
    assert s.intents == [CopyToDevice(5, 5, (0,), (9,))]
    assert s.decided == Decisions(write_acks=[4], host_entered=[page(4)], host_entered_slots=[3])
    assert [c.entry(n).last_used for n in (1, 2, 3, 4)] == [5, 3, 4, 5]
    assert c.pool() == ([], [0, 1, 2, 3], [])
    assert s.digest == 0x35033d5c22acec0c

    c.answer("loads", 5, OK)
    s = c.step(writes(WriteRequest(6, pages(5), (5,))))  # page 2 (step 3) goes first
    assert s.intents == [CopyToHost(6, (5,), (1,))]
    assert s.decided == Decisions(loads=[(5, 1)], host_left=[page(2)])
    assert s.digest == 0x1b6e819e7fef5c9d
    s = c.step(writes(WriteRequest(7, pages(6), (6,))))  # then page 3 (step 4)
    assert s.intents == [CopyToHost(7, (6,), (2,))]
    assert s.decided == Decisions(host_left=[page(3)])
    assert s.digest == 0x145c7bdf6af074f4
    s = c.step(writes(WriteRequest(8, pages(7), (7,))))  # pages 1 and 4 both used at step 5: page 1's hash is lower
    assert s.intents == [CopyToHost(8, (7,), (0,))]
    assert s.decided == Decisions(host_left=[page(1)])
    assert s.digest == 0x2a86b597f61a8175
    s = c.step(writes(WriteRequest(9, pages(8), (8,))))
    assert s.intents == [CopyToHost(9, (8,), (3,))]
    assert s.decided == Decisions(host_left=[page(4)])
    assert s.digest == 0x3721d4f5252b9828
    s = c.step(writes(WriteRequest(10, pages(9), (9,))))  # every slot is under a copy now
    assert (s.intents, s.decided) == ([], Decisions(write_failures=[10]))
    assert c.slots() == {} and c.pool() == ([], [0, 1, 2, 3], [])
    assert s.digest == 0x6ce481e0e919ca3
    assert c.digests == [  # the digest after every step
        0xcf293f8c57cfba3, 0x1ca46b93381e4c5e, 0x3686eb955159782, 0x47233f6ee77bbcd, 0x35033d5c22acec0c,
        0x1b6e819e7fef5c9d, 0x145c7bdf6af074f4, 0x2a86b597f61a8175, 0x3721d4f5252b9828, 0x6ce481e0e919ca3,
    ]


def test_a_chain_is_evicted_leaf_first():
    c = ScriptedCache(SELECTIVE)
    c.step(writes(WriteRequest(1, pages(1, 2, 3), (0, 1, 2))))
    c.answer("writes", 1, OK)
    s = c.step()
    assert s.decided == Decisions(write_acks=[1], host_entered=list(pages(1, 2, 3)), host_entered_slots=[0, 1, 2])
    assert s.digest == 0x321845bb4227ddec

    s = c.step(writes(WriteRequest(2, pages(4, 5), (3, 4))))  # one short: the leaf, page 3
    assert s.intents == [CopyToHost(2, (3, 4), (2, 3))]
    assert s.decided == Decisions(host_left=[page(3)])
    assert c.entry(2).children == 0
    assert s.digest == 0x3d10fcf16afb31f8
    s = c.step(writes(WriteRequest(3, pages(6), (5,))))  # page 2 is the leaf now
    assert (s.intents, s.decided) == ([CopyToHost(3, (5,), (1,))], Decisions(host_left=[page(2)]))
    assert s.digest == 0x350e092feeda8de5
    s = c.step(writes(WriteRequest(4, pages(7), (6,))))
    assert (s.intents, s.decided) == ([CopyToHost(4, (6,), (0,))], Decisions(host_left=[page(1)]))
    assert c.slots() == {}
    assert s.digest == 0x67f9037f565841c
    assert c.digests == [  # the digest after every step
        0x21a11d7ebb285226, 0x321845bb4227ddec, 0x3d10fcf16afb31f8, 0x350e092feeda8de5, 0x67f9037f565841c,
    ]


def test_eviction_is_all_or_nothing():
    c = ScriptedCache(SELECTIVE)
    c.step(writes(WriteRequest(1, pages(1), (0,)), WriteRequest(2, pages(2), (1,))))
    c.answer("writes", 1, OK)
    c.answer("writes", 2, OK)
    c.step()
    s = c.step(CacheRequests(loads=(LoadRequest(3, pages(1), (0,)),)))  # page 1 is read: it cannot go
    assert s.digest == 0x1fff436dab12e3d2

    s = c.step(writes(WriteRequest(4, pages(3, 4, 5, 6), (0, 1, 2, 3))))  # two short; only page 2 could go
    assert (s.intents, s.decided) == ([], Decisions(write_failures=[4]))
    assert c.slots() == {page(1): 0, page(2): 1}  # nothing was evicted
    assert c.pool() == ([2, 3], [0, 1], [])
    assert s.digest == 0x20c04f46cb22d470

    c.answer("loads", 3, OK)
    s = c.step()
    assert s.decided == Decisions(loads=[(3, 1)])
    s = c.step(writes(WriteRequest(4, pages(3, 4, 5, 6), (0, 1, 2, 3))))  # both can go now
    assert s.intents == [CopyToHost(4, (0, 1, 2, 3), (0, 1, 2, 3))]
    assert s.decided == Decisions(host_left=[page(1), page(2)])
    assert s.digest == 0x2555d154d75bf483
    assert c.digests == [  # the digest after every step
        0x16d9bd83776ad1e, 0x30b31eeb8939e80, 0x1fff436dab12e3d2, 0x20c04f46cb22d470, 0x3d5859f5c12f301a,
        0x2555d154d75bf483,
    ]


def test_a_write_never_evicts_a_page_it_found_resident():
    c = ScriptedCache(SELECTIVE, host_pages=2)
    c.step(writes(WriteRequest(1, pages(1), (0,)), WriteRequest(2, pages(2), (1,))))
    c.answer("writes", 1, OK)
    c.answer("writes", 2, OK)
    c.step()
    s = c.step(CacheRequests(loads=(LoadRequest(3, pages(2), (1,)),)))
    c.answer("loads", 3, OK)
    s = c.step()
    assert s.decided == Decisions(loads=[(3, 1)])
    assert [c.entry(1).last_used, c.entry(2).last_used] == [1, 3]
    assert s.digest == 0x33d4003c2f292f9b

    # Page 1 is the least recently used, but this write found it resident: page 2 goes instead.
    s = c.step(writes(WriteRequest(4, pages(1, 3), (0, 1))))
    assert s.intents == [CopyToHost(4, (1,), (1,))]  # only page 3 is copied
    assert s.decided == Decisions(host_left=[page(2)])
    assert s.digest == 0x2e65310c7b993b6b

    c.answer("writes", 4, OK)
    s = c.step()
    assert s.decided == Decisions(write_acks=[4], host_entered=[page(3)], host_entered_slots=[1])
    assert (c.entry(3).parent, c.entry(1).children) == (page(1), 1)  # it follows the resident page before it
    assert c.entry(1).last_used == 5  # and that page was used again
    assert s.digest == 0x371cc333918cd437
    assert c.digests == [  # the digest after every step
        0x16d9bd83776ad1e, 0x30b31eeb8939e80, 0x387aaa5421bea45f, 0x33d4003c2f292f9b, 0x2e65310c7b993b6b,
        0x371cc333918cd437,
    ]


def test_a_write_of_resident_pages_copies_only_the_new_ones_and_touches_the_others():
    c = ScriptedCache(SELECTIVE)
    c.step(writes(WriteRequest(1, pages(1, 2), (0, 1))))
    c.answer("writes", 1, OK)
    c.step()
    assert [c.entry(1).last_used, c.entry(2).last_used] == [1, 1]

    s = c.step(writes(WriteRequest(2, pages(1, 2, 3), (7, 8, 9))))
    assert s.intents == [CopyToHost(2, (9,), (2,))]
    assert [c.entry(1).last_used, c.entry(2).last_used] == [1, 1]  # touched when acknowledged, not when opened
    assert s.digest == 0x3dfd3ea0b7259c0e

    c.answer("writes", 2, OK)
    s = c.step()
    assert s.decided == Decisions(write_acks=[2], host_entered=[page(3)], host_entered_slots=[2])
    assert (c.entry(3).parent, c.entry(2).children) == (page(2), 1)
    assert [c.entry(n).last_used for n in (1, 2, 3)] == [3, 3, 3]
    assert s.digest == 0x3838a935a4a2a0ed

    # Every page resident: an empty copy, still acknowledged only once every rank answers it.
    s = c.step(writes(WriteRequest(3, pages(1, 2), (0, 1))))
    assert s.intents == [CopyToHost(3, (), ())]
    assert c.pool() == ([3], [0, 1, 2], [])
    assert s.digest == 0x1fc9f39dc4edc408
    c.answer("writes", 3, OK, PENDING)
    s = c.step()
    assert (s.answers, s.decided) == ([(3, "write outcome", PENDING)], Decisions())
    c.answer("writes", 3, OK)
    s = c.step()
    assert s.decided == Decisions(write_acks=[3])
    assert [c.entry(n).last_used for n in (1, 2, 3)] == [5, 5, 3]
    assert s.digest == 0x1c8c01fd3743318b
    assert c.digests == [  # the digest after every step
        0x12ae73e5daf48f88, 0x2d06e8787f9c8717, 0x3dfd3ea0b7259c0e, 0x3838a935a4a2a0ed, 0x1fc9f39dc4edc408,
        0x1fc9f39dc4edc408, 0x1c8c01fd3743318b,
    ]


def test_two_writes_of_one_page_both_copy_it_and_the_later_ack_frees_its_copy():
    c = ScriptedCache(SELECTIVE)
    s = c.step(writes(WriteRequest(1, pages(1), (4,)), WriteRequest(2, pages(1), (5,))))
    assert s.intents == [CopyToHost(1, (4,), (0,)), CopyToHost(2, (5,), (1,))]
    assert s.digest == 0xa6e726f601f02de

    c.answer("writes", 2, OK)  # the second write is acknowledged first: its copy enters
    s = c.step()
    assert s.decided == Decisions(write_acks=[2], host_entered=[page(1)], host_entered_slots=[1])
    assert c.pool() == ([2, 3], [0, 1], [])
    assert s.digest == 0x361b968f1490e75a

    c.answer("writes", 1, OK)
    s = c.step()
    assert s.decided == Decisions(write_acks=[1])  # nothing enters: its copy in slot 0 is a duplicate
    assert c.slots() == {page(1): 1}
    assert c.pool() == ([0, 2, 3], [1], [])
    assert s.digest == 0x35d2335838a88e57
    assert c.digests == [  # the digest after every step
        0xa6e726f601f02de, 0x361b968f1490e75a, 0x35d2335838a88e57,
    ]


def test_two_writes_of_one_page_acked_in_one_round_enter_it_in_serial_order():
    c = ScriptedCache(SELECTIVE)
    c.step(writes(WriteRequest(1, pages(1), (4,)), WriteRequest(2, pages(1), (5,))))
    c.answer("writes", 1, OK)
    c.answer("writes", 2, OK)
    s = c.step()
    assert s.decided == Decisions(write_acks=[1, 2], host_entered=[page(1)], host_entered_slots=[0])
    assert c.pool() == ([1, 2, 3], [0], [])
    assert s.digest == 0x10ce6459c4dedb66
    assert c.digests == [  # the digest after every step
        0xa6e726f601f02de, 0x10ce6459c4dedb66,
    ]


def test_under_write_through_an_ack_backs_the_new_pages_up():
    c = ScriptedCache()  # the default policy: write_through
    c.step(writes(WriteRequest(1, pages(1, 2, 3), (0, 1, 2))))
    c.answer("writes", 1, OK)
    c.step()
    s = c.step(writes(WriteRequest(2, pages(2, 3, 4), (0, 1, 2))))  # pages 2 and 3 are resident
    assert s.intents == [CopyToHost(3, (2,), (3,))]  # serial 2 is the first write's backup
    c.answer("writes", 3, OK)
    s = c.step()
    assert s.decided == Decisions(write_acks=[2], host_entered=[page(4)], host_entered_slots=[3])
    assert s.intents == [Store(4, pages(4), (3,), SHARDING)]  # only the page that entered
    assert c.open_ops() == ["2: backup 2", "4: backup 4"]
    assert c.entry(4).refs == 1 and c.entry(2).refs == 1  # backup 2 still holds pages 1 to 3
    assert s.digest == 0x39049f42c45f970c
    c.answer("backups", 2, BackupOutcome.STORED)
    c.answer("backups", 4, BackupOutcome.STORED)
    s = c.step()
    assert s.decided == Decisions(backups=[(2, True), (4, True)])
    assert all(c.entry(n).backed_up and not c.entry(n).refs for n in (1, 2, 3, 4))
    assert s.digest == 0x17b938f2759ebb59
    assert c.digests == [  # the digest after every step
        0x21a11d7ebb285226, 0xfff590c90edc899, 0x20918d0bb19a4008, 0x39049f42c45f970c, 0x17b938f2759ebb59,
    ]


def test_a_parent_acknowledged_after_its_child_stays_evictable():
    c = ScriptedCache(SELECTIVE, host_pages=3)
    c.step(writes(WriteRequest(1, pages(1), (0,))))
    c.step(writes(WriteRequest(2, pages(2), (1,), parent=page(1))))  # the next page of the same chain
    c.answer("writes", 2, OK)
    c.step()  # page 2 enters first: its parent is not resident yet
    c.answer("writes", 1, OK)
    c.step()
    c.step(CacheRequests(loads=(LoadRequest(3, pages(1), (0,)),)))  # page 1 is the more recently used
    c.answer("loads", 3, OK)
    s = c.step(writes(WriteRequest(4, pages(3), (2,)), WriteRequest(5, pages(4), (3,))))
    assert s.decided == Decisions(loads=[(3, 1)], host_left=[page(2)])
    c.answer("writes", 4, OK)
    c.answer("writes", 5, OK)
    c.step()
    assert c.entry(1).children == 0  # page 2 counted as its child when page 1 entered, and left since
    s = c.step(writes(WriteRequest(6, pages(5, 6, 7), (4, 5, 6))))  # every resident page may go
    assert s.decided == Decisions(host_left=[page(1), page(3), page(4)])
