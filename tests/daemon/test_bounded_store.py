"""A store that stops answering (its process stopped: the connection stays
open and nothing comes back) cannot hold the diagnosis of a lost peer or an
Attach past their bounds: the store calls are abandoned at their deadline.
The store is a real one, in a process of its own, stopped by SIGSTOP."""

import signal
import subprocess
import sys
import threading
import time

import pytest

from cpcache.agreement import attach, liveness
from cpcache.agreement.bounded import StoreTimeout, bounded
from cpcache.agreement.collective import GroupReducer, Rendezvous
from cpcache.errors import Unavailable

pytestmark = pytest.mark.timeout(30)


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


@pytest.fixture
def stopped_store():
    """A real rendezvous store in its own process, with a client connected
    while it answered; then the process is stopped (SIGSTOP)."""
    proc = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        rdzv = Rendezvous("127.0.0.1", port, "d", 0, timeout_s=60.0)
        connected = rdzv.connect()
        connected.set("probe", "1")
        proc.send_signal(signal.SIGSTOP)
        yield rdzv, connected
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()
        proc.stdout.close()


SERVE = ("import time; from cpcache.agreement.collective import host_store\n"
         "s = host_store('127.0.0.1', 0); print(s.port, flush=True)\n"
         "while True: time.sleep(3600)")


def test_the_diagnosis_over_a_stopped_store_answers_in_bounded_time(stopped_store):
    rdzv, connected = stopped_store
    started = time.monotonic()
    diagnosis = liveness.diagnose(rdzv, (1,), 5, window_s=0.1, store=connected)
    took = time.monotonic() - started
    assert diagnosis.missing == () and "unreachable" in diagnosis.reason, diagnosis
    assert took < 3 * liveness.CONNECT_S + 1, took


def test_an_attach_over_a_stopped_store_is_unavailable_by_its_deadline(stopped_store):
    rdzv, _ = stopped_store
    started = time.monotonic()
    with pytest.raises(Unavailable, match="rendezvous store failed"):
        attach.agree_on_attach(lambda: rdzv.connect(timeout_s=1.0), "ns", 0, (0, 1), {"geometry": "A"}, 0, 2.0,
                               GroupReducer([]))
    assert time.monotonic() - started < 2.0 + attach.STORE_CALL_S + 1
