"""`SchedulerSession.load_opened`, the overlapped load-back's step, against
scripted agreed replies: a load opened by its round returns its board slot
at once; a later reply deciding it gives the slot back after its end is
known; and an agreed failure decided while a batch is being built stops the
build in that reply (the backend's end raises), before the failed load's
slot can be claimed by another load and read as decided."""

import os

import pytest

from cpcache.client.messages import StepResult
from cpcache.client.session import SchedulerSession
from cpcache.integrations.sglang.layer_loads import LayerLoads, LoadBackFailed, OpenLoad
from cpcache.load_signals import LoadSignals

pytestmark = pytest.mark.timeout(30)

LAYERS = 4
PAGES = [bytes([i]) * 32 for i in range(3)]


class ScriptedDaemon:
    """Agreed replies: step 1 makes the pages resident; `failures[step]`
    and `landed[step]` decide loads in that step's reply."""

    def __init__(self) -> None:
        self.failures: dict[int, tuple[int, ...]] = {}
        self.landed: dict[int, dict[int, int]] = {}

    def step_later(self, step, votes=(), requests=None, epoch=None):
        reply = StepResult(step=step, round=step, decisions={}, digest=step, wire=b"",
                           host_entered=tuple(PAGES) if step == 1 else (),
                           load_failures=self.failures.pop(step, ()), loads=self.landed.pop(step, {}))
        return lambda: reply


def _stops(landed: bool) -> None:
    """The SGLang backend's end of an overlapped load."""
    if not landed:
        raise LoadBackFailed("an overlapped load-back failed on some rank")


def test_an_opened_load_keeps_its_slot_until_a_reply_decides_it():
    loads = LayerLoads(num_layers=LAYERS, timeout_s=0.5, slots=2)
    daemon = ScriptedDaemon()
    session = SchedulerSession(daemon)
    session.flush()
    ended: list[bool] = []
    op, slot = session.load_opened(PAGES[:1], [10], loads.signals, done=ended.append)
    assert session.load_pending(op) and loads.signals.in_use() == 1 and ended == []
    daemon.landed[3] = {op: 1}
    session.flush()
    assert ended == [True] and not session.load_pending(op) and loads.signals.in_use() == 0


def test_an_agreed_failure_stops_the_batch_build_before_the_slot_is_claimed_again():
    loads = LayerLoads(num_layers=LAYERS, timeout_s=0.5, slots=4)
    fd = os.dup(loads.signals.fd)
    board = LoadSignals.mapped(fd, os.fstat(fd).st_size, loads.signals.slots)  # the daemon's view
    daemon = ScriptedDaemon()
    session = SchedulerSession(daemon)
    session.flush()  # step 1: the pages are resident
    op1, slot1 = session.load_opened(PAGES[:1], [10], loads.signals, done=_stops)  # step 2 opens it
    loads.opened(OpenLoad(op1, slot1))
    board.publish(slot1, op1, 1)
    board.fail(slot1, op1)  # this rank's copy failed at layer 1
    daemon.failures[3] = (op1,)  # the next request's round decides it failed, on every rank
    with pytest.raises(LoadBackFailed):
        session.load_opened(PAGES[1:2], [11], loads.signals, done=_stops)
    # Nothing claimed the failed load's slot: a forward waiting on it still sees the failure.
    loads.set_consumer(loads.start_batch())
    with pytest.raises(LoadBackFailed, match="failed"):
        loads.wait_until(1)


def test_slots_are_claimed_again_oldest_first():
    signals = LoadSignals.create(3)
    first, second = signals.claim(1), signals.claim(2)
    signals.release(first)
    assert signals.claim(3) not in (first, second)  # the never-used slot, before the one just given back
    assert signals.claim(4) == first


def test_the_backend_opens_a_load_for_the_batch_and_stops_on_its_agreed_failure():
    """`LayerLoads.open`, the backend's overlapped load: opened by its
    round, it joins the batch being built with the host slots it is copied
    from; one ended in that round is not read; one decided failed later
    stops the rank in the reply that says so, naming the rank."""
    loads = LayerLoads(num_layers=LAYERS, timeout_s=0.5, slots=4)
    daemon = ScriptedDaemon()
    session = SchedulerSession(daemon)
    session.flush()  # step 1: the pages are resident
    daemon.failures[2] = (1,)  # op 1 fails in its opening round (step 2), everywhere
    assert not loads.open(session, PAGES[:1], [10], rank=3)
    assert loads.open(session, PAGES[1:2], [11], rank=3)  # step 3 opens op 2
    assert loads.start_batch() >= 0 and session.load_pending(2)
    daemon.failures[4] = (2,)
    with pytest.raises(LoadBackFailed, match="rank 3: an overlapped load-back failed on some rank"):
        session.flush()
