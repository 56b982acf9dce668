"""Fault injection around device <-> host copies, one instance per rank:
delays and failures drawn from a seeded generator, so a test can make one
rank's copies slow or failing while the others' are not. Load-backs can
also be slowed layer by layer, or fail at a given layer: what a forward
that reads a load as it lands must survive or stop on."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class CopyFaults:
    delay_ms: float = 0.0  # each copy waits uniform(0, delay_ms) first
    fail_rate: float = 0.0  # each copy fails (copies nothing) with this probability
    seed: int = 0
    layer_delay_ms: float = 0.0  # each layer of a load-back waits this long before its copy
    load_fail_layer: int = -1  # a load-back fails at this layer, the layers before it copied (-1: never)

    @property
    def active(self) -> bool:
        return bool(self.delay_ms or self.fail_rate or self.layer_delay_ms or self.load_fail_layer >= 0)


class InjectedCopyFailure(RuntimeError):
    pass


@dataclass(frozen=True)
class LayerFaults:
    """A load-back's faults, layer by layer."""

    delay_ms: float
    fail_layer: int

    def before_layer(self, layer: int, on_host: bool = True) -> None:
        """Wait the layer's delay here (`on_host`; else the caller queues it
        on the device), then fail if this is the layer to fail at."""
        if self.delay_ms and on_host:
            time.sleep(self.delay_ms / 1000)  # the injected latency itself
        if layer == self.fail_layer:
            raise InjectedCopyFailure(f"injected failure of a load-back at layer {layer}")


class CopyFaultInjector:
    def __init__(self, faults: CopyFaults) -> None:
        self.faults = faults
        self._random = random.Random(faults.seed)
        self._lock = threading.Lock()  # copies run on several I/O threads

    def before_copy(self) -> bool:
        """Wait the injected delay; False when this copy is to fail."""
        with self._lock:
            delay = self._random.uniform(0, self.faults.delay_ms) / 1000 if self.faults.delay_ms else 0.0
            fails = self._random.random() < self.faults.fail_rate
        time.sleep(delay)  # the injected latency itself
        return not fails

    def layer_faults(self) -> LayerFaults | None:
        """The per-layer faults of one load-back, if any are injected."""
        if not self.faults.layer_delay_ms and self.faults.load_fail_layer < 0:
            return None
        return LayerFaults(self.faults.layer_delay_ms, self.faults.load_fail_layer)
