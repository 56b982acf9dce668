"""Fault injection around a real backend, one instance per rank: delays,
failures and truncated batches, drawn from a seeded generator so a test can
make every rank see a different but reproducible storage."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cpcache.dataplane.storage import PageBuffer, StorageBackend


@dataclass(frozen=True)
class StorageFaults:
    delay_ms: float = 0.0  # each batch waits uniform(0, delay_ms) first
    fail_rate: float = 0.0  # each page of a get or put fails with this probability
    truncate_rate: float = 0.0  # a batch stops after a random prefix with this probability
    seed: int = 0

    @property
    def active(self) -> bool:
        return bool(self.delay_ms or self.fail_rate or self.truncate_rate)


class FaultyBackend(StorageBackend):
    def __init__(self, inner: StorageBackend, faults: StorageFaults) -> None:
        self.inner = inner
        self.faults = faults
        self.name = inner.name
        self._random = random.Random(faults.seed)
        self._lock = threading.Lock()

    def _draw(self, n: int) -> tuple[float, int, list[bool]]:
        """(delay, pages kept by truncation, per-page failure) for one batch."""
        with self._lock:
            delay = self._random.uniform(0, self.faults.delay_ms) / 1000 if self.faults.delay_ms else 0.0
            kept = self._random.randint(0, n) if self._random.random() < self.faults.truncate_rate else n
            fails = [self._random.random() < self.faults.fail_rate for _ in range(n)]
        return delay, kept, fails

    def exists_prefix(self, keys: list[str]) -> int:
        delay, kept, _ = self._draw(len(keys))
        time.sleep(delay)  # the injected latency itself
        return min(kept, self.inner.exists_prefix(keys))

    def _batch(self, call: Callable[[list[str], list[PageBuffer]], list[bool]], keys: list[str],
               pages: list[PageBuffer]) -> list[bool]:
        delay, kept, fails = self._draw(len(keys))
        time.sleep(delay)
        done = call(keys[:kept], pages[:kept]) + [False] * (len(keys) - kept)
        return [ok and not failed for ok, failed in zip(done, fails)]

    def get_into(self, keys: list[str], pages: list[PageBuffer]) -> list[bool]:
        return self._batch(self.inner.get_into, keys, pages)

    def put_from(self, keys: list[str], pages: list[PageBuffer]) -> list[bool]:
        return self._batch(self.inner.put_from, keys, pages)

    def counters(self) -> dict[str, int]:
        return self.inner.counters()

    def close(self) -> None:
        self.inner.close()
