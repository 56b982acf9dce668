"""Fault injection around device <-> host copies, one instance per rank:
delays and failures drawn from a seeded generator, so a test can make one
rank's copies slow or failing while the others' are not."""

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

    @property
    def active(self) -> bool:
        return bool(self.delay_ms or self.fail_rate)


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
