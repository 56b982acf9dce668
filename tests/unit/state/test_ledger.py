"""The ledger (cpcache/state/ledger.py) on its own, with real operation
objects and a real allocator: the digest that folds every change in order
(exact values pinned), serials that are never reused, the table of open
operations by serial and by the scheduler's op id, the closed serials told
once each, the policies picked by name from the config; and, through a
scripted CacheState, the step and round it records."""

from __future__ import annotations

import pytest

from cpcache.config import CacheConfig
from cpcache.errors import NotFound
from cpcache.keys import ShardingSpec
from cpcache.requests import CacheRequests, PrefetchRequest, WriteRequest
from cpcache.state.allocator import PageAllocator
from cpcache.state.ledger import Ledger
from cpcache.state.ops.backup import Backup
from cpcache.state.ops.prefetch import Prefetch
from cpcache.state.ops.retirement import Retirement
from cpcache.state.ops.write import Write
from cpcache.state.policies import BestEffort, Timeout, WaitComplete, WriteBack, WriteThrough, WriteThroughSelective
from cpcache.state.questions import CopyOutcome
from tests.unit.state.scripted import ScriptedCache, page, pages

pytestmark = pytest.mark.timeout(10)


def ledger(config: CacheConfig | None = None) -> Ledger:
    return Ledger(config or CacheConfig(), PageAllocator(4), ShardingSpec(), 16)


def test_the_digest_folds_every_change_in_order():
    a = ledger()
    assert a.digest == 0
    a.record("write", 1, 7, pages(1, 2), (0, 1))
    assert a.digest == 0x31cda1db28126d1b
    a.record("ack", 1, ())
    assert a.digest == 0x15405551fd971f89

    b = ledger()
    b.record("ack", 1, ())
    b.record("write", 1, 7, pages(1, 2), (0, 1))
    assert b.digest == 0x3aa35444dd7d989a  # the same changes in another order
    assert b.digest != a.digest
    assert 0 <= a.digest < 2**62 and 0 <= b.digest < 2**62  # room to travel negated in an int64


def test_page_lists_enter_the_digest_as_their_bytes_and_other_fields_as_their_repr():
    joined, split, listed, one = ledger(), ledger(), ledger(), ledger()
    joined.record("evict", (page(1) + page(2),))
    split.record("evict", pages(1, 2))
    listed.record("evict", [page(1), page(2)])
    one.record("evict", pages(1))
    # Concatenated (page hashes are all 32 bytes long):
    assert joined.digest == split.digest == listed.digest == 0x2b70ea3c99fc605c
    assert one.digest == 0x31904088e983b72a

    ints, text, as_list = ledger(), ledger(), ledger()
    ints.record("retire", 3, (0, 1))
    text.record("retire", "3", (0, 1))
    as_list.record("retire", 3, [0, 1])
    assert len({ints.digest, text.digest, as_list.digest}) == 3
    assert (ints.digest, text.digest, as_list.digest) == (0x3034430d699b5577, 0x16fac39a67ec4c4d, 0xbe8643e061120bf)


def test_serials_start_at_one_and_are_never_reused():
    led = ledger()
    first = Retirement(led.serial(), [0])
    led.add(first)
    led.close(first)
    assert (first.serial, led.serial(), led.serial()) == (1, 2, 3)
    assert led.digest == 0  # handing out serials changes nothing shared by itself


def test_open_operations_are_found_by_serial_and_by_the_scheduler_s_op_id():
    led = ledger()
    write = Write(led.serial(), WriteRequest(7, pages(1), (0,)), [0], [0])
    led.add(write, 7)
    retirement = Retirement(led.serial(), [3])
    led.add(retirement)  # no op id: the scheduler never names it
    prefetch = Prefetch(led.serial(), PrefetchRequest(8, pages(2), 16))
    led.add(prefetch, 8)
    assert list(led.open_ops) == [1, 2, 3] and led.by_op_id == {7: 1, 8: 3}
    assert led.find(7, Write) is write and led.find(8, Prefetch) is prefetch
    assert led.find(7, Prefetch) is None and led.find(8, Write) is None and led.find(9, Write) is None
    assert led.of_kind(Write) == [write] and led.of_kind(Retirement) == [retirement] and led.of_kind(Backup) == []

    led.close(write, 7)
    led.close(retirement)
    assert list(led.open_ops) == [3] and led.by_op_id == {8: 3}
    assert led.find(7, Write) is None
    assert led.take_closed() == [1, 2]
    assert led.take_closed() == []  # each told once
    led.close(prefetch, 8)
    assert led.take_closed() == [3]
    assert led.digest == 0  # opening and closing are recorded by the operation kinds, not here


@pytest.mark.parametrize(("prefetch_policy", "kind"), [("best_effort", BestEffort), ("wait_complete", WaitComplete),
                                                        ("timeout", Timeout)])
def test_the_prefetch_policy_is_picked_by_name(prefetch_policy, kind):
    assert type(ledger(CacheConfig(prefetch_policy=prefetch_policy)).prefetch_policy) is kind


@pytest.mark.parametrize(("write_policy", "kind", "flags"), [
    ("write_through", WriteThrough, (True, False, False)),
    ("write_through_selective", WriteThroughSelective, (False, True, False)),
    ("write_back", WriteBack, (False, False, True)),
])
def test_the_write_policy_is_picked_by_name_and_only_write_back_tracks_pages_not_backed_up(write_policy, kind, flags):
    led = ledger(CacheConfig(write_policy=write_policy))
    policy = led.write_policy
    assert type(policy) is kind
    assert (policy.backup_after_ack, policy.backup_when_hot, policy.backup_before_evict) == flags
    if policy.backup_before_evict:
        assert led.index.least_recent_unbacked(1) == []
    else:
        with pytest.raises(AssertionError, match="does not track pages not backed up"):
            led.index.least_recent_unbacked(1)


def test_the_timeout_policy_ends_a_prefetch_complete_or_strictly_late():
    config = CacheConfig(prefetch_policy="timeout", prefetch_timeout_base_s=2.0,
                         prefetch_timeout_per_ki_token_s=0.5, prefetch_timeout_max_s=3.0)
    policy = ledger(config).prefetch_policy
    assert [config.prefetch_timeout_s(t) for t in (0, 1024, 4096)] == [2.0, 2.5, 3.0]  # capped
    assert policy.may_end(True, 0.0, 1024)
    assert not policy.may_end(False, 2.5, 1024)
    assert policy.may_end(False, 2.5001, 1024)
    assert policy.may_end(False, 3.01, 1 << 20)


def test_a_fresh_ledger_holds_nothing():
    led = ledger()
    assert (led.digest, led.step, led.round, led.writes_refused) == (0, 0, 0, 0)
    assert led.hit_pages == {"host": 0, "storage": 0}
    assert (led.open_ops, led.by_op_id, list(led.ended_prefetches), led.stores, len(led.index)) == ({}, {}, [], [], 0)


def test_the_ledger_records_the_step_that_opened_last_and_the_round_applied_last():
    c = ScriptedCache()
    led = c.state.ledger
    c.step(CacheRequests(writes=(WriteRequest(1, pages(1), (0,)),)))
    assert (led.step, led.round) == (1, 1)
    c.step()  # opens nothing
    assert (led.step, led.round) == (1, 2)
    c.answer("writes", 1, CopyOutcome.OK)
    c.step()
    assert (led.step, led.round) == (1, 3)
    assert c.entry(1).last_used == 1  # what the ack stamps its pages with
    with pytest.raises(NotFound, match="is not open"):
        c.step(CacheRequests(prefetch_polls=(5,)))  # refused: neither changes
    assert (led.step, led.round) == (1, 3)
    c.step(CacheRequests(prefetches=(PrefetchRequest(5, pages(2), 16),)))
    assert (led.step, led.round) == (5, 5)
    assert led.digest == 0x2d184f8a0575b5ae
    assert c.digests == [  # the digest after every step
        0xcf293f8c57cfba3, 0xcf293f8c57cfba3, 0x33f26e73b2f80cdd, 0x33f26e73b2f80cdd, 0x2d184f8a0575b5ae,
    ]
