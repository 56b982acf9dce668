"""SGLang's layer-transfer counter over the load-signal board: a batch that
loads nothing never waits; a batch's layer l waits for layer l of its own
loads only; a failed copy or one that never comes stops the forward with
LoadBackFailed; decided loads are forgotten."""

import os
import threading
import time

import pytest

from cpcache.integrations.sglang.layer_loads import LayerLoads, LoadBackFailed, OpenLoad
from cpcache.load_signals import LoadSignals

pytestmark = pytest.mark.timeout(30)


def _daemon(loads: LayerLoads) -> LoadSignals:
    fd = os.dup(loads.signals.fd)
    return LoadSignals.mapped(fd, os.fstat(fd).st_size, loads.signals.slots)


def test_a_batch_that_loads_nothing_never_waits():
    loads = LayerLoads(num_layers=4, timeout_s=0.01)
    assert loads.start_batch() == -1
    loads.set_consumer(-1)
    loads.wait_until(3)  # returns at once


def test_layer_l_waits_for_layer_l_of_its_batch_only():
    loads = LayerLoads(num_layers=4, timeout_s=10)
    daemon = _daemon(loads)
    slot = loads.signals.claim(op=5)
    loads.opened(OpenLoad(5, slot))
    index = loads.start_batch()
    assert index >= 0 and loads.start_batch() == -1  # the next batch loads nothing
    loads.set_consumer(index)
    daemon.publish(slot, 5, 1)
    loads.wait_until(0)  # layer 0 landed
    threading.Timer(0.05, lambda: daemon.publish(slot, 5, 4)).start()
    started = time.monotonic()
    loads.wait_until(3)
    assert time.monotonic() - started >= 0.04


def test_a_failed_or_missing_copy_stops_the_forward():
    loads = LayerLoads(num_layers=2, timeout_s=0.05)
    daemon = _daemon(loads)
    slot = loads.signals.claim(op=9)
    loads.opened(OpenLoad(9, slot))
    loads.set_consumer(loads.start_batch())
    with pytest.raises(LoadBackFailed, match="did not land"):
        loads.wait_until(0)  # nothing published within timeout_s
    daemon.publish(slot, 9, 1)
    daemon.fail(slot, 9)
    with pytest.raises(LoadBackFailed, match="failed"):
        loads.wait_until(1)


def test_decided_loads_are_forgotten_and_their_batch_waits_no_more():
    loads = LayerLoads(num_layers=2, timeout_s=0.01)
    slot = loads.signals.claim(op=3)
    loads.opened(OpenLoad(3, slot))
    index = loads.start_batch()
    loads.forget_decided(lambda op: op != 3)
    loads.set_consumer(index)
    loads.wait_until(1)  # nothing left to wait for, though nothing was published
