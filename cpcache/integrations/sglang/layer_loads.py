"""SGLang's layer-transfer counter, fed by the daemon: the forward of a
batch reads layer l of its KV once layer l of this rank's loads for it has
landed, while later layers are still being copied.

SGLang asks the KV pool's counter `wait_until(layer)` before every read of
a layer's buffers (`get_key_buffer`, `get_value_buffer`), for the batch
named by `set_consumer` (the index `ready_to_load_host_cache` gave it when
it was built; -1: a batch that loads nothing, which never waits).

A load's open is agreed (its round opened it on every rank before the
scheduler builds on it); what the forward waits for is only this rank's
own copy, published on the daemon's load-signal board. A copy that fails
(or never comes: its daemon is gone or stuck) must not be read: the
forward stops with `LoadBackFailed`, which stops the rank and with it the
server, loudly, rather than compute on KV that is not there. So does a
load whose board slot went to another load (the board fails closed), and
an agreed failure of a load whose batch may already have run (another
rank's copy failed).

A batch's loads have one deadline, `timeout_s` after the batch first
waits, for all its layers: a forward waits at most `timeout_s` in all,
however slowly a living daemon publishes layer after layer. It starts at
the first wait, not when the loads were opened: the time the scheduler
takes to build and launch the batch is not the daemon's to answer for.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cpcache.integrations.sglang.orphan_loads import OrphanLoads
from cpcache.integrations.sglang.timing import SchedulerTime
from cpcache.load_signals import SLOTS, LoadSignals

if TYPE_CHECKING:
    from cpcache.client.session import SchedulerSession

log = logging.getLogger(__name__)
LOOK_UP_S = 0.2  # how often a wait looks whether the daemon died
STOP_WAIT_S = 5.0  # how long a stuck daemon, killed, is waited for to exit


class LoadBackFailed(RuntimeError):
    """A load some forward reads did not land: this rank must stop."""


@dataclass(frozen=True)
class OpenLoad:
    """A load a forward may read: its op, its board slot, and where its
    pages come from and go (to finish it here if its daemon dies)."""

    op: int
    slot: int
    host_slots: tuple[int, ...] = ()
    device_pages: tuple[int, ...] = ()


class LayerLoads:
    def __init__(self, num_layers: int, timeout_s: float, cuda_device: Any = None, slots: int = SLOTS) -> None:
        self.num_layers = num_layers
        self.signals = LoadSignals.create(slots)
        self._timeout_s = timeout_s
        self._building: list[OpenLoad] = []  # opened for the batch being built
        self._batches: dict[int, list[OpenLoad]] = {}  # batch index -> its loads not yet decided
        # Finishes a load whose daemon died (None: the host pool is not shared).
        self.orphans: OrphanLoads | None = None
        self.clock: SchedulerTime | None = None  # counts the forward's waits (the backend's, once attached)
        self._finished_here: set[int] = set()  # loads this scheduler copied itself
        self._deadlines: dict[int, float] = {}  # batch index -> when its loads' time runs out (time.monotonic)
        self._next_index = 0
        self.consumer_index = -1
        # On CUDA hosts, one event per slot and layer, recorded by the daemon after the layer's copies.
        self._events: list[list[Any]] | None = None
        self._handles: list[bytes] = []
        if cuda_device is not None:
            import torch

            with torch.cuda.device(cuda_device):  # an event is created on the current device, at its first use
                self._events = [[torch.cuda.Event(interprocess=True) for _ in range(num_layers)]
                                for _ in range(slots)]
                self._handles = [event.ipc_handle() for layer_events in self._events for event in layer_events]

    def event_handles(self) -> list[bytes]:
        """The IPC handles the daemon records into, slot-major (none without CUDA)."""
        return list(self._handles)

    def rebind(self, signals: LoadSignals, orphans: OrphanLoads | None = None) -> None:
        """A new board, for a new attach: loads of the last one are forgotten."""
        self.signals = signals
        if self.orphans is not None:
            self.orphans.close()
        self.orphans = orphans
        self._finished_here.clear()
        self._building.clear()
        self._batches.clear()
        self._deadlines.clear()

    def has_room(self) -> bool:
        return self.signals.in_use() < self.signals.slots

    def open(self, session: SchedulerSession, pages: list[bytes], device_pages: list[int], rank: int) -> bool:
        """Load `pages` into `device_pages` for the batch being built, once
        the load's round opened it (each layer of the forward then waits for
        its own copy): -> whether the forward may read them (False: the load
        ended in its opening round, and no copy of it runs)."""
        def decided(landed: bool) -> None:
            if not landed:
                # Agreed alike on every rank: some rank's copy of a load that a
                # forward reads (or is about to) failed. Stop here, in the reply
                # that says so, before anything else is built or sent on it.
                raise LoadBackFailed(f"cpcache: rank {rank}: an overlapped load-back failed on some rank after "
                                     "its batch was built; stopping the rank rather than serve from that KV")

        opened = session.load_opened(pages, device_pages, self.signals, done=decided)
        if opened is None:
            return False
        op, slot = opened
        host_slots = session.host.slots(pages)
        finishable = all(s >= 0 for s in host_slots)  # every reply named its pages' slots
        self.opened(OpenLoad(op, slot, tuple(host_slots) if finishable else (), tuple(device_pages)))
        return True

    def opened(self, load: OpenLoad) -> None:
        """A load of the batch being built, opened on every rank."""
        self._building.append(load)

    # -- SGLang's counter ---------------------------------------------------------------

    def start_batch(self) -> int:
        """`ready_to_load_host_cache`: the index the batch just built waits on; -1 when it loads nothing."""
        if not self._building:
            return -1
        index, self._next_index = self._next_index, self._next_index + 1
        self._batches[index], self._building = self._building, []
        return index

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def wait_until(self, layer: int) -> None:
        loads = self._batches.get(self.consumer_index)
        if not loads:
            return
        with self.clock.load_wait() if self.clock is not None else contextlib.nullcontext():
            self._wait_layer(loads, layer)

    def _wait_layer(self, loads: list[OpenLoad], layer: int) -> None:
        # One deadline for the whole load, fixed at the batch's first wait.
        deadline = self._deadlines.setdefault(self.consumer_index, time.monotonic() + self._timeout_s)
        for load in loads:
            op, slot = load.op, load.slot
            if op in self._finished_here:
                continue
            try:
                landed = self._wait(load, layer + 1, deadline)
            except TimeoutError as exc:
                if self._finish_here(load, stop=True):
                    continue
                raise LoadBackFailed(f"cpcache: the load-back read by this forward did not land: {exc} "
                                     f"({self._timeout_s:g} s for all its layers); its daemon is gone or stuck, "
                                     f"and this rank cannot compute on that KV") from None
            if landed is None:  # finished here: its daemon died
                continue
            if not landed and self.orphans is not None and self.orphans.daemon_gone() \
                    and self._finish_here(load, stop=False):
                continue  # its daemon gave it up as it died
            if not landed:
                if not self.signals.owns(slot, op):
                    raise LoadBackFailed(f"cpcache: the load-back (op {op}) read by this forward lost its board "
                                         f"slot {slot} to another load before layer {layer} landed; this rank "
                                         f"cannot tell whether that KV is there")
                raise LoadBackFailed(f"cpcache: the load-back (op {op}) read by this forward failed at or before "
                                     f"layer {layer} on this rank; this rank cannot compute on that KV")
            if self._events is not None:
                import torch

                torch.cuda.current_stream().wait_event(self._events[slot - 1][layer])

    def _wait(self, load: OpenLoad, layers: int, deadline: float) -> bool | None:
        """`LoadSignals.wait`, looking up from it now and then to see
        whether the daemon died (then the load is finished here: None)."""
        while True:
            look_up = deadline if self.orphans is None else min(deadline, time.monotonic() + LOOK_UP_S)
            try:
                return self.signals.wait(load.slot, load.op, layers, look_up)
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                assert self.orphans is not None
                if self.orphans.daemon_gone() and self._finish_here(load, stop=False):
                    return None

    def _finish_here(self, load: OpenLoad, stop: bool) -> bool:
        """Copy what `load` has not landed of from the host pool, once its
        daemon has surely exited (`stop`: kill it first if it is stuck).
        -> whether the load is complete now."""
        orphans = self.orphans
        if orphans is None or not load.host_slots or not self.signals.owns(load.slot, load.op):
            return False
        if not orphans.stop_daemon(STOP_WAIT_S if stop else 0.0):
            return False
        landed = self.signals.progress(load.slot, load.op)
        # The board says landed (on CUDA too: the daemon publishes a layer once
        # its event completed); a dead daemon's queued copies of the rest
        # ended with its context, before the exit the pidfd saw.
        first = max(landed, 0)
        orphans.copy(load.host_slots, load.device_pages, first)
        self._finished_here.add(load.op)
        log.warning("cpcache: finished load %d here (layers %d to %d, %d pages): its daemon died before copying "
                    "them", load.op, first, self.num_layers - 1, len(load.device_pages))
        return True

    def reset(self) -> None:
        self.consumer_index = -1

    # -- the scheduler's bookkeeping ---------------------------------------------------

    def forget_decided(self, pending: Callable[[int], bool]) -> None:
        """Drop the loads no longer `pending` (decided: every rank's copy ended)."""
        if not self._batches:
            return
        for index in list(self._batches):
            still = [load for load in self._batches[index] if pending(load.op)]
            if still:
                self._batches[index] = still
            else:
                del self._batches[index]
                self._deadlines.pop(index, None)
