"""A store that stops answering (its process stopped: the connection stays
open and nothing comes back) cannot hold the diagnosis of a lost peer past
its bound: the store calls are abandoned at their deadline."""

import threading
import time

import pytest

from cpcache.agreement import liveness
from cpcache.agreement.bounded import StoreTimeout, bounded
from cpcache.agreement.collective import Rendezvous

pytestmark = pytest.mark.timeout(30)


class StoppedStore:
    """Answers nothing, ever (until released at the end of the test)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def multi_get(self, keys):
        self.release.wait()
        raise RuntimeError("connection reset")


def test_a_call_that_never_answers_is_abandoned_at_its_deadline():
    blocked = threading.Event()
    started = time.monotonic()
    with pytest.raises(StoreTimeout, match="no answer within 0.2s"):
        bounded(blocked.wait, 0.2)
    assert time.monotonic() - started < 2
    blocked.set()
    assert bounded(lambda: 7, 1.0) == 7
    with pytest.raises(KeyError):
        bounded(lambda: {}["missing"], 1.0)


def test_the_diagnosis_over_a_stopped_store_answers_in_bounded_time(monkeypatch):
    stopped = StoppedStore()
    rdzv = Rendezvous("127.0.0.1", 1, "d", 0, timeout_s=60.0)
    monkeypatch.setattr(Rendezvous, "connect", lambda self, timeout_s=None: stopped)  # a new one is stopped too
    started = time.monotonic()
    try:
        diagnosis = liveness.diagnose(rdzv, (1,), 5, window_s=0.1, store=stopped)
    finally:
        stopped.release.set()
    took = time.monotonic() - started
    assert diagnosis.missing == () and "unreachable" in diagnosis.reason, diagnosis
    assert took < 3 * liveness.CONNECT_S + 1, took
