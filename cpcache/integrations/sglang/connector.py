"""The scheduler's side of one rank's daemon, as SGLang's radix cache uses it.

Everything here is deterministic given the agreed replies: every rank's
scheduler makes the same calls in the same order, so every rank sends the
same steps and reads the same decisions. Nothing here runs a collective, and
between two steps nothing here calls the daemon: host matches are answered
from a mirror of the host pool's contents that the steps' replies keep up to
date (agreed state), so a rank whose daemon died cannot answer a match
differently from its peers; it learns of the death at the next step, where
its peers learn of it too.

The scheduler never waits for a round in a common iteration: the
per-iteration hook takes the reply of the step it sent at the last iteration
(its round ran during the forward pass) and sends the next one (`iterate`).
Only a load (whose pages must be on the device before the batch runs), a
flush and a drain wait for their own steps.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cpcache.client.core import Client, StepResult
from cpcache.client.session import HiCacheSession
from cpcache.errors import Unavailable

log = logging.getLogger(__name__)


@dataclass
class Tally:
    """What the cache asked of the daemon and what was agreed, for reports."""

    steps: int = 0
    loads: int = 0
    loaded_pages: int = 0
    load_failures: int = 0
    writes: int = 0
    write_acks: int = 0
    write_failures: int = 0
    writes_cancelled: int = 0
    prefetches: int = 0
    prefetched_pages: int = 0
    step_seconds: float = 0.0  # in flush(), whoever called it (perf_counter)


@dataclass
class DecisionLog:
    """Every agreed decision this rank's scheduler took, in order, across
    attaches: ranks are compared by it (equal on every rank at every
    iteration, or the model's collectives would have parted)."""

    entries: list[tuple] = field(default_factory=list)
    _session_start: int = 0

    def add(self, decisions: tuple) -> None:
        self.entries.append(decisions)

    def digest(self) -> str:
        return _digest_of(self.entries)

    def begin_session(self) -> None:
        """An attach: a rank whose daemon died just after a round may lack that
        round's reply (docs/sglang.md, "When the daemon is down"), so logs
        are also compared session by session."""
        self._session_start = len(self.entries)

    def session(self) -> tuple[int, str]:
        """(steps, digest) since the last attach."""
        since = self.entries[self._session_start :]
        return len(since), _digest_of(since)


def _digest_of(entries: list[tuple]) -> str:
    return hashlib.sha256("".join(map(repr, entries)).encode()).hexdigest()[:16]


@dataclass
class SchedulerTime:
    """The backend's own time on the scheduler thread since start (two
    perf_counter reads per call SGLang makes), logged at each flush_cache:
    what cpcache adds to a scheduler iteration. SGLang's scheduler calls
    check_hicache_events once per loop, idle loops included."""

    iterations: int = 0  # check_hicache_events calls
    hook_s: float = 0.0  # in check_hicache_events, its step included
    calls_s: float = 0.0  # cpcache's part of the other calls: match_prefix, insert, init_load_back, prefetches
    steps: int = 0  # of the connectors so far, whoever sent them (the hook, a load, a flush's drain)
    step_s: float = 0.0
    idle: int = 0  # iterations whose hook neither took a reply nor sent a step
    idle_s: float = 0.0  # the hook's time in those

    def tick(self, seconds: float, idle: bool) -> None:
        """One check_hicache_events call."""
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


class HostMirror:
    """The pages resident in the daemon's host pool, as of the last reply."""

    def __init__(self) -> None:
        self._pages: set[bytes] = set()

    def follow(self, reply: StepResult) -> None:
        self._pages.difference_update(reply.host_left)
        self._pages.update(reply.host_entered)

    def prefix(self, pages: list[bytes]) -> int:
        for i, page in enumerate(pages):
            if page not in self._pages:
                return i
        return len(pages)

    def __len__(self) -> int:
        return len(self._pages)


class Connector:
    def __init__(self, client: Client, first_step: int, load_timeout_s: float = 30.0,
                 decisions: DecisionLog | None = None) -> None:
        self.client = client
        self.session = HiCacheSession(client, first_step=first_step)
        self.load_timeout_s = load_timeout_s
        self.tally = Tally()
        self.host = HostMirror()
        self.decisions = decisions  # kept when asked (settings.record_decisions)
        self._write_done: dict[int, Callable[[bool], None]] = {}  # write op -> called with stored?
        self._in_flight: Callable[[], StepResult] | None = None  # the step sent by `iterate`, not yet taken

    # -- asks ---------------------------------------------------------------------

    def match(self, pages: list[bytes]) -> int:
        """Pages of `pages`, from the first, resident in the host pool (the
        agreed state as of the last step, the same on every rank)."""
        return self.host.prefix(pages)

    def write(self, pages: list[bytes], device_pages: list[int], parent: bytes | None,
              done: Callable[[bool], None]) -> None:
        """A write-through of device pages; `done(acked)` once it is decided."""
        op = self.session.write_backup(pages, device_pages, parent)
        self._write_done[op] = done
        self.tally.writes += 1

    def prefetch(self, rid: str, pages: list[bytes], tokens: int, parent: bytes | None) -> None:
        self.session.prefetch_from_storage(rid, pages, tokens, parent)
        self.tally.prefetches += 1

    def load_now(self, pages: list[bytes], device_pages: list[int]) -> bool:
        """Load host pages into device pages and return once every rank has
        them (True) or the load failed on some rank (False), as agreed."""
        self.settle()
        if self.host.prefix(pages) < len(pages):
            # The step that was in flight when the pages were matched evicted
            # some of them: known alike on every rank, so a failure like any.
            self.tally.loads += 1
            self.tally.load_failures += 1
            return False
        op = self.session.load_back(pages, device_pages)
        self.tally.loads += 1
        deadline = time.monotonic() + self.load_timeout_s
        loaded: set[int] = set()
        failed: set[int] = set()
        # Writes queued since this iteration's step wait for the next one: on
        # an overlapping scheduler their KV (a chunk just launched) may not be
        # computed yet, and their step is where the scheduler has synchronized.
        held = self.session.hold_writes()
        try:
            while op not in loaded and op not in failed:
                if time.monotonic() > deadline:
                    raise Unavailable(f"load of {len(pages)} pages not decided in {self.load_timeout_s} s")
                self.flush()
                loaded.update(self.session.loading_check())
                failed.update(self.session.load_failures_check())
        finally:
            self.session.release_writes(held)
        ok = op in loaded
        if ok:
            self.tally.loaded_pages += len(pages)
        else:
            self.tally.load_failures += 1
        return ok

    def cancel_unsent_writes(self) -> int:
        """Forget the writes no step has carried yet (their device pages are
        being freed): each is decided as not stored. -> how many."""
        cancelled = self.session.cancel_unsent_writes()
        for op in cancelled:
            self.tally.writes_cancelled += 1
            self._write_done.pop(op)(False)
        return len(cancelled)

    def drain_writes(self) -> None:
        """Step until every write a step carried is decided: only then may
        their device pages be freed (the daemon may still be copying them)."""
        self.settle()
        deadline = time.monotonic() + self.load_timeout_s
        while self._write_done:
            if time.monotonic() > deadline:
                raise Unavailable(f"{len(self._write_done)} writes not decided in {self.load_timeout_s} s")
            self.flush()

    # -- the iteration boundary -------------------------------------------------------

    def busy(self) -> bool:
        """Whether a step is in flight, or the next one has anything to send or wait for.

        Its inputs are this scheduler's own calls since the last step and what
        agreed replies left open (writes a step carried, not yet decided; open
        prefetches): alike on every rank at the same iteration, never local I/O
        progress or timing. So every rank skips the same iterations, and the
        number of rounds stays a function of the scheduler's iterations
        (DESIGN.md, section 2, rule 2)."""
        return (self._in_flight is not None or self.session.has_pending() or bool(self._write_done)
                or self.session.open_prefetches() > 0)

    def writes_in_flight(self) -> int:
        return len(self._write_done)

    def iterate(self) -> bool:
        """Once per scheduler iteration, on every rank: take the reply of the
        step sent at the last iteration, then send this iteration's step if
        anything waits for one, without waiting for its round: the round runs
        while the scheduler goes on, and its decisions are taken at the next
        iteration (or before anything else that needs them), alike on every
        rank. What the reply changes was built on, at the earliest, after it
        was taken: every step is checked by the daemon against the state the
        scheduler last read. An iteration with nothing to say (`busy`) costs
        no call and no round. -> whether a reply was taken or a step sent."""
        if not self.busy():
            return False
        self.settle()
        if self.busy():
            started = time.perf_counter()
            try:
                self._in_flight = self.session.send()
            finally:
                self.tally.step_seconds += time.perf_counter() - started
        return True

    def in_flight(self) -> bool:
        return self._in_flight is not None

    def settle(self) -> StepResult | None:
        """Take the reply of the step in flight, if any (waiting for it)."""
        if self._in_flight is None:
            return None
        receive, self._in_flight = self._in_flight, None
        started = time.perf_counter()
        try:
            return self._took(receive())
        finally:
            self.tally.step_seconds += time.perf_counter() - started

    def flush(self) -> StepResult:
        """One step, waited for (after the one in flight)."""
        self.settle()
        started = time.perf_counter()
        try:
            return self._took(self.session.flush())
        finally:
            self.tally.step_seconds += time.perf_counter() - started

    def _took(self, reply: StepResult) -> StepResult:
        self.tally.steps += 1
        self.host.follow(reply)
        if self.decisions is not None:
            self.decisions.add(_decisions(reply))
        for op in self.session.writing_check():
            self.tally.write_acks += 1
            self._write_done.pop(op)(True)
        for op in self.session.write_failures_check():
            self.tally.write_failures += 1
            self._write_done.pop(op)(False)
        self.tally.prefetched_pages += sum(reply.prefetch_done.values())
        return reply


def _decisions(reply: StepResult) -> tuple:
    return (reply.step, reply.round, sorted(reply.prefetch_done.items()), sorted(reply.prefetch_revoked),
            sorted(reply.write_acks), sorted(reply.write_failures), sorted(reply.loads.items()),
            sorted(reply.load_failures), reply.digest)
