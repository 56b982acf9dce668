"""Calls into the decode server's store, each answered within its deadline
(cpcache/integrations/sglang/store_calls.py): a call past it is a miss, the
calls behind it fail at once until it returns, and what it returns with,
even a failure nobody waits for any more, is said."""

import logging
import threading

import pytest

from cpcache.integrations.sglang.store_calls import BoundedCalls

pytestmark = pytest.mark.timeout(30)


def test_a_call_past_its_deadline_is_a_miss_and_the_next_fail_at_once_until_it_returns(caplog):
    calls = BoundedCalls(timeout_s=0.05)
    release = threading.Event()

    def stalled(_guard):
        release.wait(20)
        raise OSError("the store went away")

    assert calls.call("a write of 1 pages", stalled, "miss") == "miss"
    assert calls.stalled and calls.call("a read of 1 pages", lambda g: "hit", "miss") == "miss"
    assert (calls.timed_out, calls.skipped) == (1, 1)
    with caplog.at_level(logging.WARNING):
        release.set()
        assert calls.wait_answered(10)
    calls.timeout_s = 10.0  # the answered call below must not race a loaded host's thread start
    assert not calls.stalled and calls.call("a read of 1 pages", lambda g: "hit", "miss") == "hit"
    assert any("it failed: OSError('the store went away')" in r.getMessage() for r in caplog.records)


def test_a_call_given_up_touches_no_host_slot_after():
    calls = BoundedCalls(timeout_s=0.05)
    release, touched = threading.Event(), []

    def late(guard):
        release.wait(20)
        with guard.host_slots() as waited:
            touched.append(waited)
        return "late"

    assert calls.call("a read of 1 pages", late, "miss") == "miss"
    release.set()
    assert calls.wait_answered(10) and touched == [False]
