"""SGLang's layer-transfer counter fails closed: one deadline for all the
layers of a batch's loads (a living daemon that publishes each layer just
in time for a per-layer deadline still stops the forward once the whole
load's time is up), and a load whose board slot went to another load stops
the forward instead of reading as landed. Time is a fake clock: no test
sleeps."""

import os

import pytest

from cpcache import load_signals
from cpcache.integrations.sglang import layer_loads
from cpcache.integrations.sglang.layer_loads import LayerLoads, LoadBackFailed, OpenLoad
from cpcache.load_signals import LoadSignals

pytestmark = pytest.mark.timeout(30)

TIMEOUT_S = 10.0
LAYERS = 4


class SlowDaemon:
    """A fake clock whose naps let a daemon publish one more layer of
    `op` every `per_layer_s`: what a stalled but living daemon looks like
    to the forward."""

    def __init__(self, board: LoadSignals, slot: int, op: int, per_layer_s: float) -> None:
        self.now = 1000.0
        self.board, self._slot, self._op = board, slot, op
        self._published_at = [self.now + (layer + 1) * per_layer_s for layer in range(LAYERS)]

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += 0.25  # coarser than the real nap: a few hundred polls per layer, not a million
        layers = sum(self.now >= at for at in self._published_at)
        if layers:
            self.board.publish(self._slot, self._op, layers)


def _daemon(loads: LayerLoads) -> LoadSignals:
    fd = os.dup(loads.signals.fd)
    return LoadSignals.mapped(fd, os.fstat(fd).st_size, loads.signals.slots)


def _batch_of(loads: LayerLoads, op: int) -> int:
    slot = loads.signals.claim(op)
    loads.opened(OpenLoad(op, slot))
    index = loads.start_batch()
    loads.set_consumer(index)
    return slot


@pytest.fixture
def slow_daemon(monkeypatch):
    def install(loads: LayerLoads, op: int, slot: int, per_layer_s: float) -> SlowDaemon:
        clock = SlowDaemon(_daemon(loads), slot, op, per_layer_s)
        monkeypatch.setattr(load_signals, "time", clock)
        monkeypatch.setattr(layer_loads, "time", clock)
        return clock

    return install


def test_layers_each_just_under_the_timeout_stop_the_forward_once_the_whole_load_is_late(slow_daemon):
    loads = LayerLoads(num_layers=LAYERS, timeout_s=TIMEOUT_S)
    slot = _batch_of(loads, op=5)
    clock = slow_daemon(loads, 5, slot, per_layer_s=TIMEOUT_S * 0.9)
    started = clock.now
    loads.wait_until(0)  # layer 0 at 9 s: within the load's 10 s
    with pytest.raises(LoadBackFailed, match="did not land"):
        loads.wait_until(1)  # layer 1 would come at 18 s: past the one deadline, not 9 s after layer 0
    assert clock.now - started <= TIMEOUT_S + 1


def test_a_load_that_lands_within_its_time_is_read_whole(slow_daemon):
    loads = LayerLoads(num_layers=LAYERS, timeout_s=TIMEOUT_S)
    slot = _batch_of(loads, op=6)
    clock = slow_daemon(loads, 6, slot, per_layer_s=TIMEOUT_S / LAYERS * 0.9)
    for layer in range(LAYERS):
        loads.wait_until(layer)
    assert clock.now - 1000.0 < TIMEOUT_S


def test_each_batch_has_a_deadline_of_its_own(slow_daemon):
    loads = LayerLoads(num_layers=LAYERS, timeout_s=TIMEOUT_S)
    first = _batch_of(loads, op=7)
    clock = slow_daemon(loads, 7, first, per_layer_s=1.0)
    for layer in range(LAYERS):
        loads.wait_until(layer)
    loads.forget_decided(lambda op: op != 7)
    clock.now += 3 * TIMEOUT_S  # later iterations: the first batch's deadline long past
    second = _batch_of(loads, op=8)
    clock.board.publish(second, 8, 1)
    loads.wait_until(0)  # the second batch's time starts at its own first wait


def test_a_slot_claimed_again_stops_the_forward_still_waiting_on_its_old_load():
    loads = LayerLoads(num_layers=LAYERS, timeout_s=TIMEOUT_S, slots=1)
    daemon = _daemon(loads)
    slot = _batch_of(loads, op=3)
    loads.signals.release(slot)  # given back while a forward still waits on it (never, if the backend is right)
    assert loads.signals.claim(op=4) == slot
    daemon.publish(slot, 4, LAYERS)  # the new load landed whole
    with pytest.raises(LoadBackFailed, match="lost its board slot"):
        loads.wait_until(0)
