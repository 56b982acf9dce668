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
(or never comes: its daemon is gone, within `timeout_s`) must not be read:
the forward stops with `LoadBackFailed`, which stops the rank and with it
the server, loudly, rather than compute on KV that is not there. So does
an agreed failure of a load whose batch may already have run (another
rank's copy failed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from cpcache.load_signals import SLOTS, LoadSignals


class LoadBackFailed(RuntimeError):
    """A load some forward reads did not land: this rank must stop."""


class LayerLoads:
    def __init__(self, num_layers: int, timeout_s: float, cuda_device: Any = None, slots: int = SLOTS) -> None:
        self.num_layers = num_layers
        self.signals = LoadSignals.create(slots)
        self._timeout_s = timeout_s
        self._building: list[tuple[int, int]] = []  # (op, slot) opened for the batch being built
        self._batches: dict[int, list[tuple[int, int]]] = {}  # batch index -> its loads not yet decided
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

    def rebind(self, signals: LoadSignals) -> None:
        """A new board, for a new attach: loads of the last one are forgotten."""
        self.signals = signals
        self._building.clear()
        self._batches.clear()

    def has_room(self) -> bool:
        return self.signals.in_use() < self.signals.slots

    def opened(self, op: int, slot: int) -> None:
        """A load of the batch being built, opened on every rank."""
        self._building.append((op, slot))

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
        deadline = time.monotonic() + self._timeout_s
        for op, slot in loads:
            try:
                landed = self.signals.wait(slot, op, layer + 1, deadline)
            except TimeoutError as exc:
                raise LoadBackFailed(f"cpcache: the load-back read by this forward did not land: {exc}; "
                                     f"its daemon is gone or stuck, and this rank cannot compute on that KV") from None
            if not landed:
                raise LoadBackFailed(f"cpcache: the load-back (op {op}) read by this forward failed at or before "
                                     f"layer {layer} on this rank; this rank cannot compute on that KV")
            if self._events is not None:
                import torch

                torch.cuda.current_stream().wait_event(self._events[slot - 1][layer])

    def reset(self) -> None:
        self.consumer_index = -1

    # -- the scheduler's bookkeeping ---------------------------------------------------

    def forget_decided(self, pending: Callable[[int], bool]) -> None:
        """Drop the loads no longer `pending` (decided: every rank's copy ended)."""
        if not self._batches:
            return
        for index in list(self._batches):
            still = [(op, slot) for op, slot in self._batches[index] if pending(op)]
            if still:
                self._batches[index] = still
            else:
                del self._batches[index]
