"""Where a step's time goes on this rank: one latency histogram per phase,
written on the event loop (the agreement thread keeps its own for the
collective itself: `AgreementEngine.round_latency`).

The phases of a step, in order:

- `check`: this rank's checks of the step (`Stepper._refusal`);
- `pack`: reading this rank's I/O progress and packing the round's vector;
- `submit`: handing the round to the agreement thread;
- `wait`: the step's task waiting for its round's outcome to reach the loop:
  the engine's queue, waiting for the peers and the collective (`reduce`,
  from the engine), and the hand-offs back to the loop;
- `open`: opening the step's operations in the shared state;
- `apply`: applying the round's answers to the shared state;
- `io`: starting this rank's I/O the reply waits for (loads: a scheduler
  may wait for one as soon as it is told it opened);
- `io_after_reply`: starting the rest of that I/O (writes, backups,
  lookups, fetches), once the reply has left and before the next round is
  packed: off the reply's path;
- `reply`: building the reply message (the daemon's wire layer);
- `handler`: the whole call in the daemon, from the request read to the
  reply built; what it does not cover is gRPC's and the transport's.

The phases that never await (all but `wait` and `handler`) also count the
loop thread's CPU time (`time.thread_time`): on a host whose cores are
shared, their wall time includes waiting for a core, their CPU time is what
the work itself costs.

A phase may be observed more than once per step (`io` is, when a step both
opens operations and applies answers): a breakdown per step divides each
phase's total by the number of steps, not by its own count."""

from __future__ import annotations

import time

from cpcache.histogram import Histogram

PHASES = ("check", "pack", "submit", "wait", "open", "apply", "io", "io_after_reply", "reply", "handler")
# No await inside these: the thread's CPU is theirs.
CPU_PHASES = ("check", "pack", "submit", "open", "apply", "io", "io_after_reply")


# Finer at the low end than the round histogram: most phases take microseconds.
PHASE_BOUNDS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                  5.0, 10.0)


class StepPhases:
    def __init__(self) -> None:
        self.histograms = {phase: Histogram(PHASE_BOUNDS_S) for phase in PHASES}
        self.cpu_s = dict.fromkeys(CPU_PHASES, 0.0)  # the loop thread's CPU seconds, in total

    def observe(self, phase: str, seconds: float, cpu_s: float = 0.0) -> None:
        self.histograms[phase].observe(seconds)
        if phase in self.cpu_s:
            self.cpu_s[phase] += cpu_s

    def clock(self) -> PhaseClock:
        return PhaseClock(self)


class PhaseClock:
    """Laps of one step: each `lap(phase)` observes the time since the last."""

    __slots__ = ("_phases", "_last", "_last_cpu")

    def __init__(self, phases: StepPhases) -> None:
        self._phases = phases
        self._last = time.perf_counter()
        self._last_cpu = time.thread_time()

    def lap(self, phase: str) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        self._phases.observe(phase, now - self._last, cpu - self._last_cpu)
        self._last, self._last_cpu = now, cpu
