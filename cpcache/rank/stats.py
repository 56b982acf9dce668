"""What a rank counts, read once per ask: the `Stats` RPC's counters and the
metrics scrape are two views of the same `RankStats`, taken on the event
loop (the values belong to it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cpcache.agreement.engine import AgreementEngine
from cpcache.histogram import Histogram
from cpcache.rank.assembly import CacheRuntime
from cpcache.rank.stepper import Stepper


@dataclass(frozen=True)
class Buckets:
    """A histogram's counts per bucket and its total, copied."""

    counts: tuple[int, ...]
    total_s: float

    @classmethod
    def of(cls, histogram: Histogram) -> Buckets:
        return cls(tuple(histogram.counts), histogram.total_s)


@dataclass(frozen=True)
class EngineStats:
    rounds: int
    divergences: int
    peer_lost: bool
    round_latency: Buckets


@dataclass(frozen=True)
class StepStats:
    last_step: int
    decisions: int
    rejected_steps: int
    open_questions: int
    phases: dict[str, Buckets]
    phase_cpu_s: dict[str, float]


@dataclass(frozen=True)
class CacheStats:
    state: dict[str, int]  # `CacheState.stats()`: host pages by use, open operations, hits
    digest: int
    hits: dict[str, int]  # pages served, by tier
    in_flight_slots: int
    moved: dict[str, dict[tuple[str, str], int]]  # `Transfers.counters()`: by (source, destination)
    storage: dict[str, int] = field(default_factory=dict)  # the backend's own counters


@dataclass(frozen=True)
class RankStats:
    engine: EngineStats | None = None  # None before the domain first formed, and while it re-forms
    steps: StepStats | None = None
    cache: CacheStats | None = None  # None until a device pool is attached

    @classmethod
    def of(cls, engine: AgreementEngine | None, stepper: Stepper | None) -> RankStats:
        engine_stats = step_stats = cache_stats = None
        if engine is not None:
            engine_stats = EngineStats(engine.rounds_completed, engine.divergences, engine.failure is not None,
                                       Buckets.of(engine.round_latency))
        if stepper is not None:
            step_stats = StepStats(
                stepper.last_step, stepper.decision_count, stepper.rejected_steps, stepper.open_questions,
                {name: Buckets.of(h) for name, h in stepper.phases.histograms.items()}, dict(stepper.phases.cpu_s))
            if stepper.runtime is not None:
                cache_stats = _cache_stats(stepper.runtime)
        return cls(engine_stats, step_stats, cache_stats)

    def counters(self) -> dict[str, int]:
        """The `Stats` RPC's counters."""
        counters = {"rounds_completed": self.engine.rounds if self.engine else 0}
        steps, cache = self.steps, self.cache
        if steps is None:
            return counters
        counters["last_step"] = steps.last_step
        counters["decisions"] = steps.decisions
        if cache is not None:
            counters.update(cache.state)
            counters["cache_digest"] = cache.digest
            counters["in_flight_slots"] = cache.in_flight_slots
            # Jobs of an ended session the movers refused (docs/design.md rule 10).
            counters["refused_late_jobs"] = sum(cache.moved["refused_jobs"].values())
            for (src, dst), pages in cache.moved["pages_moved"].items():
                counters[f"pages_moved_{src}_to_{dst}"] = pages
                counters[f"bytes_moved_{src}_to_{dst}"] = cache.moved["bytes_moved"][(src, dst)]
            counters.update(cache.storage)
        counters["rejected_steps"] = steps.rejected_steps
        counters.update(self.phase_counters())
        return counters

    def phase_counters(self) -> dict[str, int]:
        """The step phases as counters: `step_phase_<phase>_us` (total
        microseconds), `step_phase_<phase>_count` and, for the phases that
        never await, `step_phase_<phase>_cpu_us` (the loop thread's CPU),
        with the collective itself as phase `reduce` (from the agreement
        engine) and `steps` (the calls the handler served), so a breakdown
        per step is each total over `steps`."""
        out: dict[str, int] = {}
        if self.steps is None:
            return out
        phases = dict(self.steps.phases)
        if self.engine is not None:
            phases["reduce"] = self.engine.round_latency
        for name, buckets in phases.items():
            out[f"step_phase_{name}_us"] = round(buckets.total_s * 1e6)
            out[f"step_phase_{name}_count"] = sum(buckets.counts)
        for name, seconds in self.steps.phase_cpu_s.items():
            out[f"step_phase_{name}_cpu_us"] = round(seconds * 1e6)
        out["step_phase_steps"] = out.get("step_phase_handler_count", 0)
        return out


def _cache_stats(runtime: CacheRuntime) -> CacheStats:
    storage = runtime.io.storage
    ledger = runtime.state.ledger
    state = dict(runtime.state.stats())
    state.update({f"lost_hit_pages_{reason}": n for reason, n in runtime.short_reads.items()})
    return CacheStats(state, ledger.digest, dict(ledger.hit_pages),
                      len(runtime.io.busy_slots()), runtime.io.transfer_counters(),
                      storage.counters() if storage is not None else {})
