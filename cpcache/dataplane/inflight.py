"""This rank's I/O reference counts per host slot (docs/design.md rule 5). Local
state, written by I/O threads: never part of the replicated state."""

from __future__ import annotations

import threading
from collections.abc import Iterable


class InFlight:
    """This rank's I/O reference counts per host slot (docs/design.md rule 5)."""

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)

    def begin(self, slots: list[int]) -> None:
        with self._lock:
            for slot in slots:
                self._counts[slot] = self._counts.get(slot, 0) + 1

    def end(self, slots: list[int]) -> None:
        with self._lock:
            for slot in slots:
                left = self._counts[slot] - 1
                if left:
                    self._counts[slot] = left
                else:
                    del self._counts[slot]
            self._idle.notify_all()

    def slots(self) -> list[int]:
        """The slots with I/O in flight now."""
        with self._lock:
            return sorted(self._counts)

    def count(self) -> int:
        """Slots with I/O in flight."""
        with self._lock:
            return len(self._counts)

    def busy(self, slots: Iterable[int]) -> bool:
        with self._lock:
            return any(slot in self._counts for slot in slots)

    def wait_all_idle(self, timeout_s: float) -> bool:
        """Until no slot has I/O in flight (True), or `timeout_s` passes (False)."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._counts, timeout_s)

    def wait_idle(self, slots: Iterable[int], timeout_s: float) -> bool:
        with self._lock:
            return self._idle.wait_for(lambda: not any(s in self._counts for s in slots), timeout_s)
