"""The backend's own time on SGLang's scheduler thread: what cpcache adds to
a scheduler iteration."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from cpcache.client.outcomes import Tally


@dataclass
class Iteration:
    """One per-iteration hook being timed: its caller marks it idle when it
    neither took a reply nor sent a step."""

    idle: bool = False


@dataclass
class SchedulerTime:
    """The backend's time on the scheduler thread since start (two
    perf_counter reads per call SGLang makes), logged at each flush_cache.
    SGLang's scheduler calls check_hicache_events once per loop, idle loops
    included. The steps and their time are the sessions' own (`Tally`),
    read when the line is written."""

    iterations: int = 0  # check_hicache_events calls
    hook_s: float = 0.0  # in check_hicache_events, its step included
    calls_s: float = 0.0  # cpcache's part of the other calls: match_prefix, insert, init_load_back, prefetches
    idle: int = 0  # iterations whose hook neither took a reply nor sent a step
    idle_s: float = 0.0  # the hook's time in those
    kinds: dict[str, list[float]] = field(default_factory=dict)  # call kind -> [seconds, calls]
    load_wait_s: float = 0.0  # the forward's waits for its load-backs' layers (overlapped loads)
    load_waits: int = 0  # layer waits of a forward that read a load-back

    @contextlib.contextmanager
    def call(self, kind: str) -> Iterator[None]:
        """Time cpcache's part of one of SGLang's calls (`kind`: which, as
        the line names it: match, insert, load_back, prefetch, progress)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - started
            self.calls_s += seconds
            spent = self.kinds.get(kind)
            if spent is None:
                spent = self.kinds[kind] = [0.0, 0]
            spent[0] += seconds
            spent[1] += 1

    @contextlib.contextmanager
    def load_wait(self) -> Iterator[None]:
        """Time one wait of the forward for a layer of its load-backs."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.load_wait_s += time.perf_counter() - started
            self.load_waits += 1

    @contextlib.contextmanager
    def hook(self) -> Iterator[Iteration]:
        """Time one per-iteration hook (check_hicache_events); the caller
        marks the `Iteration` it is given idle if it was."""
        iteration = Iteration()
        started = time.perf_counter()
        try:
            yield iteration
        finally:
            self.tick(time.perf_counter() - started, iteration.idle)

    def tick(self, seconds: float, idle: bool) -> None:
        """One per-iteration hook took `seconds`."""
        self.iterations += 1
        self.hook_s += seconds
        if idle:
            self.idle += 1
            self.idle_s += seconds

    def line(self, rank: int, sessions: Iterable[Tally] = ()) -> str:
        """The logged line (tools/bench/sglang_backend.py reads it back);
        `sessions`: the tallies of every session so far, whoever sent their
        steps (the hook, a load, a flush's drain)."""
        tallies = list(sessions)
        steps = sum(t.steps for t in tallies)
        step_s = sum(t.step_seconds for t in tallies)
        wait_s = sum(t.reply_wait_seconds for t in tallies)
        total = self.hook_s + self.calls_s
        mean_us = total / self.iterations * 1e6 if self.iterations else 0.0
        return (f"cpcache: rank {rank} backend: {self.iterations} iterations, mean {mean_us:.3f} us per iteration "
                f"on the scheduler thread (hook {self.hook_s:.6f} s, other calls {self.calls_s:.6f} s), "
                f"{steps} steps, {step_s:.6f} s in steps ({wait_s:.6f} s waiting for replies); "
                f"{self.idle} idle iterations "
                f"(no step taken or sent), {self.idle_s:.6f} s in their hook; calls {self._kinds_text()}; "
                f"loads waited {self.load_wait_s:.6f} s in {self.load_waits} layer waits")

    def _kinds_text(self) -> str:
        spent = sorted(self.kinds.items())
        return ", ".join(f"{kind} {seconds:.6f} s x {calls}" for kind, (seconds, calls) in spent) or "none"
