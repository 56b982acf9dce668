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
- `io`: starting this rank's I/O for what was opened and decided;
- `reply`: building the reply message (the daemon's wire layer);
- `handler`: the whole call in the daemon, from the request read to the
  reply built; what it does not cover is gRPC's and the transport's.

A phase may be observed more than once per step (`io` is, when a step both
opens operations and applies answers): a breakdown per step divides each
phase's total by the number of steps, not by its own count."""

from __future__ import annotations

import time

from cpcache.histogram import Histogram

PHASES = ("check", "pack", "submit", "wait", "open", "apply", "io", "reply", "handler")


# Finer at the low end than the round histogram: most phases take microseconds.
PHASE_BOUNDS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                  5.0, 10.0)


class StepPhases:
    def __init__(self) -> None:
        self.histograms = {phase: Histogram(PHASE_BOUNDS_S) for phase in PHASES}

    def observe(self, phase: str, seconds: float) -> None:
        self.histograms[phase].observe(seconds)

    def clock(self) -> PhaseClock:
        return PhaseClock(self)


class PhaseClock:
    """Laps of one step: each `lap(phase)` observes the time since the last."""

    __slots__ = ("_phases", "_last")

    def __init__(self, phases: StepPhases) -> None:
        self._phases = phases
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self._phases.observe(phase, now - self._last)
        self._last = now
