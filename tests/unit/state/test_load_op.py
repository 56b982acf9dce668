"""The load-back operation (cpcache/state/ops/load.py), step by step on a real
CacheState with two scripted ranks:

- a load opens only with every page resident (else the step is refused,
  changing nothing), references and touches its pages, counts them as host
  hits, and ends loaded once every rank's copy ended well, or failed when
  one rank's copy failed (MIN of the outcomes);
- while open it pins its pages: no write or prefetch may evict them, and
  two loads of a page hold it twice (and, under write_through_selective,
  make it hot: backed up);
- a load opens before the other operations of its step, whatever their
  order in the request; its signal slot reaches its copy and nothing else;
- at lag 1 a load whose page was evicted after the step was checked fails
  on its own, the rest of its step opening.
"""

from __future__ import annotations

import pytest

from cpcache.errors import InvalidArgument, NotFound
from cpcache.requests import CacheRequests, LoadRequest, PrefetchRequest, WriteRequest
from cpcache.state.intents import CopyToDevice, CopyToHost, Decisions, Lookup, Store
from cpcache.state.questions import BackupOutcome
from tests.unit.state.scripted import FAILED, OK, PENDING, SELECTIVE, SHARDING, ScriptedCache, page, pages

pytestmark = pytest.mark.timeout(10)



def loads(*reqs: LoadRequest) -> CacheRequests:
    return CacheRequests(loads=reqs)


def test_a_load_references_its_pages_until_every_rank_copied_them():
    c = ScriptedCache(SELECTIVE)
    c.write_and_ack(1, 1, 2)  # serial 1; pages 1 and 2 in slots 0 and 1, used at step 1
    s = c.step(loads(LoadRequest(9, pages(1, 2), (3, 4))))
    assert s.intents == [CopyToDevice(2, 9, (0, 1), (3, 4), 0)]
    assert s.decided == Decisions()
    assert c.ledger.by_op_id == {9: 2} and c.open_ops() == ["2: load 9"]
    assert [(c.entry(n).refs, c.entry(n).hits, c.entry(n).last_used) for n in (1, 2)] == [(1, 1, 3), (1, 1, 3)]
    assert c.ledger.hit_pages == {"host": 2, "storage": 0}  # counted when it opens
    assert c.state.stats()["open_loads"] == 1
    assert s.digest == 0x3072b7f6730b4012
    opened = s.digest

    c.answer("loads", 2, OK, PENDING)
    s = c.step()
    assert s.answers == [(2, "load outcome", PENDING)]
    assert (s.decided, s.digest) == (Decisions(), opened)

    c.answer("loads", 2, OK)
    s = c.step()
    assert s.answers == [(2, "load outcome", OK)]
    assert s.decided == Decisions(loads=[(9, 2)])
    assert [c.entry(n).refs for n in (1, 2)] == [0, 0]
    assert c.ledger.by_op_id == {} and c.open_ops() == []
    assert c.ranks[0].forgotten == [1, 2]
    assert c.slots() == {page(1): 0, page(2): 1}  # loading leaves them resident
    assert s.digest == 0x6ce148c28121cdf
    assert c.digests == [  # the digest after every step
        0x12ae73e5daf48f88, 0x2d06e8787f9c8717, 0x3072b7f6730b4012, 0x3072b7f6730b4012, 0x6ce148c28121cdf,
    ]


def test_a_load_of_a_page_not_in_host_is_refused_and_changes_nothing():
    c = ScriptedCache(SELECTIVE)
    c.write_and_ack(1, 1, 2)
    before = c.digest
    assert before == 0x2d06e8787f9c8717
    with pytest.raises(NotFound, match=r"^load 9: page 1 \(0303030303030303\) is not in host$"):
        c.step(loads(LoadRequest(9, pages(1, 3), (0, 1))))
    assert (c.digest, c.open_ops(), c.entry(1).refs, c.ledger.hit_pages["host"]) == (before, [], 0, 0)

    c.step(CacheRequests(writes=(WriteRequest(2, pages(3), (2,)),)))  # page 3 is being written: not in host yet
    with pytest.raises(NotFound, match=r"^load 10: page 0 \(0303030303030303\) is not in host$"):
        c.step(loads(LoadRequest(10, pages(3), (0,))))
    assert c.open_ops() == ["2: write 2"]
    assert c.digests == [  # the digest after every step
        0x12ae73e5daf48f88, 0x2d06e8787f9c8717, 0x2d06e8787f9c8717, 0x3e546f793b9f0430, 0x3e546f793b9f0430,
    ]


def test_a_copy_that_failed_on_one_rank_fails_the_load_and_the_pages_stay():
    c = ScriptedCache(SELECTIVE)
    c.write_and_ack(1, 1, 2)
    opened = c.step(loads(LoadRequest(9, pages(1, 2), (3, 4)))).digest
    assert opened == 0x3072b7f6730b4012

    c.answer("loads", 2, PENDING, FAILED)  # rank 0 may still be reading the slots
    s = c.step()
    assert (s.answers, s.decided, s.digest) == ([(2, "load outcome", PENDING)], Decisions(), opened)
    assert c.entry(1).refs == 1

    c.answer("loads", 2, OK, FAILED)
    s = c.step()
    assert s.answers == [(2, "load outcome", FAILED)]
    assert s.decided == Decisions(load_failures=[9])
    assert [c.entry(n).refs for n in (1, 2)] == [0, 0]
    assert c.slots() == {page(1): 0, page(2): 1}
    assert c.ledger.hit_pages == {"host": 2, "storage": 0}  # a hit still, though its copy failed
    assert s.digest == 0x124dc7f906194c0b
    assert c.digests == [  # the digest after every step
        0x12ae73e5daf48f88, 0x2d06e8787f9c8717, 0x3072b7f6730b4012, 0x3072b7f6730b4012, 0x124dc7f906194c0b,
    ]


def test_an_open_load_pins_its_pages_against_writes_and_prefetches():
    c = ScriptedCache(SELECTIVE, host_pages=2)
    c.write_and_ack(1, 1, 2)
    s = c.step(loads(LoadRequest(9, pages(1, 2), (3, 4))))
    assert s.intents == [CopyToDevice(2, 9, (0, 1), (3, 4), 0)]

    s = c.step(CacheRequests(writes=(WriteRequest(2, pages(3), (2,)),),
                             prefetches=(PrefetchRequest(3, pages(5), 16),)))
    assert s.intents == [Lookup(3, pages(5), SHARDING)]  # the write is refused: only the prefetch's lookup
    assert s.decided == Decisions(write_failures=[2])
    assert c.open_ops() == ["2: load 9", "3: prefetch 3"]
    assert s.digest == 0x28b6fd44ba7d6c69

    c.answer("lookups", 3, 1)
    s = c.step()
    assert s.answers == [(2, "load outcome", PENDING), (3, "prefetch hit", 1)]
    assert s.decided == Decisions(prefetch_hits=[(3, 1)], prefetch_revoked=[(3, "host pool full: 1 pages do not fit")])
    assert c.slots() == {page(1): 0, page(2): 1}
    assert s.digest == 0x3e3024ce95f97fe7

    c.answer("loads", 2, OK)
    s = c.step()
    assert s.decided == Decisions(loads=[(9, 2)])
    s = c.step(CacheRequests(writes=(WriteRequest(2, pages(3), (2,)),)))  # unpinned: the leaf goes
    assert s.intents == [CopyToHost(4, (2,), (1,))]
    assert s.decided == Decisions(host_left=[page(2)])
    assert s.digest == 0x3830875e3b4c7e03
    assert c.digests == [  # the digest after every step
        0x12ae73e5daf48f88, 0x2d06e8787f9c8717, 0x3072b7f6730b4012, 0x28b6fd44ba7d6c69, 0x3e3024ce95f97fe7,
        0x2ee7d3137c6e86b4, 0x3830875e3b4c7e03,
    ]


def test_two_loads_of_a_page_hold_it_twice_and_make_it_hot():
    c = ScriptedCache(SELECTIVE)
    c.write_and_ack(1, 1, 2)
    s = c.step(loads(LoadRequest(9, pages(1), (0,)), LoadRequest(10, pages(1, 2), (1, 2))))
    # Page 1 is loaded back a second time: write_through_selective backs it up (backup 4).
    assert s.intents == [CopyToDevice(2, 9, (0,), (0,), 0), CopyToDevice(3, 10, (0, 1), (1, 2), 0),
                         Store(4, pages(1), (0,), SHARDING)]
    assert c.open_ops() == ["2: load 9", "3: load 10", "4: backup 4"]
    assert [(c.entry(n).refs, c.entry(n).hits) for n in (1, 2)] == [(3, 2), (1, 1)]
    assert c.ledger.hit_pages["host"] == 3
    assert s.digest == 0x1be5acd69e55bcf1

    c.answer("loads", 2, OK)
    s = c.step()
    assert s.answers == [(2, "load outcome", OK), (3, "load outcome", PENDING), (4, "backup outcome", 0)]
    assert s.decided == Decisions(loads=[(9, 1)])
    assert [c.entry(n).refs for n in (1, 2)] == [2, 1]
    c.answer("loads", 3, OK)
    s = c.step()
    assert s.decided == Decisions(loads=[(10, 2)])
    assert [c.entry(n).refs for n in (1, 2)] == [1, 0]
    c.answer("backups", 4, BackupOutcome.STORED)
    s = c.step()
    assert s.decided == Decisions(backups=[(4, True)])
    assert [(c.entry(n).refs, c.entry(n).backed_up) for n in (1, 2)] == [(0, True), (0, False)]
    assert s.digest == 0x34d0e86b9458685e
    assert c.digests == [  # the digest after every step
        0x12ae73e5daf48f88, 0x2d06e8787f9c8717, 0x1be5acd69e55bcf1, 0x2f241f94576e0b6f, 0xf1d7e002d861769,
        0x34d0e86b9458685e,
    ]


def test_a_load_opens_before_the_write_of_its_step_which_cannot_evict_it():
    c = ScriptedCache(SELECTIVE, host_pages=2)
    c.write_and_ack(1, 1)  # page 1 used at step 1
    c.write_and_ack(2, 2)  # page 2 at step 3
    # Listed first, the write still opens after the load: page 1, the least recently used, is read.
    s = c.step(CacheRequests(writes=(WriteRequest(3, pages(3), (0,)),), loads=(LoadRequest(9, pages(1), (7,)),)))
    assert s.intents == [CopyToDevice(3, 9, (0,), (7,), 0), CopyToHost(4, (0,), (1,))]
    assert s.decided == Decisions(host_left=[page(2)])
    assert c.ledger.by_op_id == {9: 3, 3: 4}
    assert s.digest == 0x2373bd29b940b911
    assert c.digests == [  # the digest after every step
        0xcf293f8c57cfba3, 0x258f2b48061b677a, 0x31ed10a13e8d7240, 0xadf374f46f8415, 0x2373bd29b940b911,
    ]


def test_a_load_signal_slot_reaches_its_copy_only():
    c = ScriptedCache(SELECTIVE)
    c.write_and_ack(1, 1)
    with pytest.raises(InvalidArgument, match=r"^load 9: signal slot 1 is outside the attached load-signal board "
                                              r"\(0 slots\)$"):
        c.step(loads(LoadRequest(9, pages(1), (5,), signal_slot=1)))
    c.state.signal_slots = 2  # a pool attached with a board of two slots
    with pytest.raises(InvalidArgument, match=r"signal slot 3 is outside the attached load-signal board \(2 slots\)"):
        c.step(loads(LoadRequest(9, pages(1), (5,), signal_slot=3)))
    s = c.step(loads(LoadRequest(9, pages(1), (5,), signal_slot=2)))
    assert s.intents == [CopyToDevice(2, 9, (0,), (5,), 2)]

    plain = ScriptedCache(SELECTIVE)
    plain.write_and_ack(1, 1)
    plain.step()
    plain.step()  # the same step numbers: the two refused steps took theirs
    t = plain.step(loads(LoadRequest(9, pages(1), (5,))))
    assert t.intents == [CopyToDevice(2, 9, (0,), (5,), 0)]
    assert s.digest == t.digest == 0x29478c68737797f8  # local, never agreed: not in the digest
    assert c.digests == [  # the digest after every step
        0xcf293f8c57cfba3, 0x258f2b48061b677a, 0x258f2b48061b677a, 0x258f2b48061b677a, 0x29478c68737797f8,
    ]
    assert plain.digests == [  # the digest after every step
        0xcf293f8c57cfba3, 0x258f2b48061b677a, 0x258f2b48061b677a, 0x258f2b48061b677a, 0x29478c68737797f8,
    ]


def test_at_lag_one_a_load_of_a_page_evicted_meanwhile_fails_on_its_own():
    c = ScriptedCache(SELECTIVE, host_pages=2, lag=1)
    s = c.step(CacheRequests(writes=(WriteRequest(1, pages(1), (0,)), WriteRequest(2, pages(2), (1,)))))
    assert (s.applied, s.intents) == (0, [])  # its round applies in the next step
    s = c.step()
    assert (s.applied, s.intents) == (1, [CopyToHost(1, (0,), (0,)), CopyToHost(2, (1,), (1,))])
    c.answer("writes", 1, OK)
    c.answer("writes", 2, OK)
    s = c.step()  # round 2 was packed before the answers
    assert (s.applied, s.answers, s.decided) == (2, [(1, "write outcome", 0), (2, "write outcome", 0)], Decisions())
    s = c.step()
    assert s.decided == Decisions(write_acks=[1, 2], host_entered=list(pages(1, 2)), host_entered_slots=[0, 1])
    assert s.digest == 0x30b31eeb8939e80

    s = c.step(CacheRequests(writes=(WriteRequest(3, pages(3), (2,)),)))
    # Checked while page 1 is still resident; the write's round, applied next, evicts it.
    s = c.step(loads(LoadRequest(9, pages(1), (4,)), LoadRequest(10, pages(2), (5,))))
    assert s.applied == 5
    assert s.intents == [CopyToHost(3, (2,), (0,))]
    assert s.decided == Decisions(host_left=[page(1)])  # the least recently used: tie at step 1, lower hash
    assert s.digest == 0x100da1da45889cba

    s = c.step()
    assert s.applied == 6
    assert isinstance(s.refused, NotFound)
    assert str(s.refused) == "load 9: page 0 (0101010101010101) is not in host"
    assert s.intents == [CopyToDevice(4, 10, (1,), (5,), 0)]  # load 10 opened alone
    assert s.decided == Decisions(load_failures=[9])
    assert c.ledger.by_op_id == {3: 3, 10: 4}
    assert s.digest == 0x211fae97ce717397
    assert c.digests == [  # the digest after every step
        0x0, 0x16d9bd83776ad1e, 0x16d9bd83776ad1e, 0x30b31eeb8939e80, 0x30b31eeb8939e80, 0x100da1da45889cba,
        0x211fae97ce717397,
    ]
