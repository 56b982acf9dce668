"""The backend's own time on SGLang's scheduler thread: what cpcache adds to
a scheduler iteration."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class SchedulerTime:
    """The backend's time on the scheduler thread since start (two
    perf_counter reads per call SGLang makes), logged at each flush_cache.
    SGLang's scheduler calls check_hicache_events once per loop, idle loops
    included."""

    iterations: int = 0  # check_hicache_events calls
    hook_s: float = 0.0  # in check_hicache_events, its step included
    calls_s: float = 0.0  # cpcache's part of the other calls: match_prefix, insert, init_load_back, prefetches
    steps: int = 0  # of the sessions so far, whoever sent them (the hook, a load, a flush's drain)
    step_s: float = 0.0
    idle: int = 0  # iterations whose hook neither took a reply nor sent a step
    idle_s: float = 0.0  # the hook's time in those

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Time cpcache's part of one of SGLang's calls."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.calls_s += time.perf_counter() - started

    def tick(self, seconds: float, idle: bool) -> None:
        """One per-iteration hook (check_hicache_events) took `seconds`."""
        self.iterations += 1
        self.hook_s += seconds
        if idle:
            self.idle += 1
            self.idle_s += seconds

    def line(self, rank: int) -> str:
        total = self.hook_s + self.calls_s
        mean_us = total / self.iterations * 1e6 if self.iterations else 0.0
        return (f"cpcache: rank {rank} backend: {self.iterations} iterations, mean {mean_us:.3f} us per iteration "
                f"on the scheduler thread (hook {self.hook_s:.6f} s, other calls {self.calls_s:.6f} s), "
                f"{self.steps} steps, {self.step_s:.6f} s in steps; {self.idle} idle iterations "
                f"(no step taken or sent), {self.idle_s:.6f} s in their hook")
