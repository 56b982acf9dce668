"""One rank's scheduler side of its daemon: the one session that the SGLang
backend, the simulator and the soak drive.

The cache operations of a scheduler iteration are collected and sent
together as one `Step` (one agreement round); its reply is followed: the
operations it decided are closed (each with its `done` callback), the
mirror of the host pool moves, the tally and the decision log grow
(`operations.py`, `SessionOperations`: what is collected, open and
decided). Every rank's scheduler makes the same calls in the same order and
reads the same agreed replies, so every rank's session holds the same state
at the same iteration, by construction, and nothing here runs a collective.

Two ways to send. A synchronous scheduler gives the session its blocking
`Client` and calls `iterate` once per iteration: it takes the reply of the
step sent at the last iteration (its round ran meanwhile) and sends this
iteration's step without waiting for it (this module). An asyncio
scheduler, or a driver of several ranks, takes `next_step()`, sends it
itself, and hands the reply to `follow`.

Each SGLang call and its counterpart here: docs/sglang-backend.md (the call table).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from cpcache.client.core import Client
from cpcache.client.messages import StepResult
from cpcache.client.operations import Brought, Landed, SessionOperations, Stored
from cpcache.client.outcomes import DecisionLog
from cpcache.errors import Unavailable
from cpcache.load_signals import LoadSignals

__all__ = ["Brought", "Landed", "SchedulerSession", "SessionOperations", "Stored"]


class SchedulerSession(SessionOperations):
    """One rank's scheduler-side session: its operations (`SessionOperations`),
    sent over its client one step per scheduler iteration, and the calls
    that wait for agreed decisions (`load_now`, `load_opened`,
    `drain_writes`)."""

    def __init__(self, client: Client | None = None, first_step: int = 1, *, decision_timeout_s: float = 30.0,
                 decisions: DecisionLog | None = None, epoch: int | None = None) -> None:
        """`client`: for the synchronous calls (`iterate`, `flush`,
        `load_now`, `load_opened`, `drain_writes`); None when the caller
        sends each step. `decision_timeout_s`: how long a synchronous wait
        for agreed decisions (`load_now`, `drain_writes`) steps before
        `Unavailable`. `decisions` and `epoch`: as `SessionOperations`."""
        super().__init__(first_step, decisions=decisions, epoch=epoch)
        self.client = client
        self.decision_timeout_s = decision_timeout_s
        self._in_flight: Callable[[], StepResult] | None = None  # a step sent, its reply not yet taken

    # -- the synchronous scheduler's iteration ---------------------------------------------

    def busy(self) -> bool:
        """Whether a step is in flight, or anything is collected or open (a
        prefetch waiting for its next poll included)."""
        return self.needs_step() or bool(self._prefetches)

    def needs_step(self) -> bool:
        """Whether a step is in flight, or the next one has anything to send
        or a round may decide (`awaits_decisions`).

        Its inputs are this scheduler's own calls since the last step and what
        agreed replies left open: alike on every rank at the same iteration,
        never local I/O progress or timing. So every rank skips the same
        iterations, and the number of rounds stays a function of the
        scheduler's iterations (docs/design.md rule 2)."""
        return self._in_flight is not None or self.has_unsent() or self.awaits_decisions()

    def in_flight(self) -> bool:
        return self._in_flight is not None

    def iterate(self) -> bool:
        """Once per scheduler iteration, on every rank: take the reply of the
        step sent at the last iteration, then send this iteration's step if
        anything waits for one, without waiting for its round: its decisions
        are taken at the next iteration (or before anything else that needs
        them), alike on every rank. What the reply changes was built on, at
        the earliest, after it was taken: every step is checked by the daemon
        against the state the scheduler last read. An iteration with nothing
        to say (`needs_step`) costs no call and no round. -> whether a reply was
        taken or a step sent."""
        if not self.needs_step():
            return False
        self.take_reply()
        if self.needs_step():
            with self._timed():
                self._send()
        return True

    def take_reply(self) -> StepResult | None:
        """Take the reply of the step in flight, if any (waiting for it)."""
        if self._in_flight is None:
            return None
        receive, self._in_flight = self._in_flight, None
        with self._timed():
            return self.follow(self._receive(receive))

    def flush(self) -> StepResult:
        """One step, waited for (after the one in flight)."""
        self.take_reply()
        with self._timed():
            self._send()
            receive, self._in_flight = self._in_flight, None
            assert receive is not None
            return self.follow(self._receive(receive))

    def _receive(self, receive: Callable[[], StepResult]) -> StepResult:
        """A step's reply, its wait counted (a wait that raised too)."""
        started = time.perf_counter()
        try:
            return receive()
        finally:
            self.tally.reply_wait_seconds += time.perf_counter() - started

    def _send(self) -> None:
        assert self.client is not None, "a session without a client: its caller sends each step (next_step)"
        step, requests = self.next_step()
        self._in_flight = self.client.step_later(step, requests=requests, epoch=self.epoch)

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.tally.step_seconds += time.perf_counter() - started

    def load_now(self, pages: list[bytes], device_pages: list[int]) -> bool:
        """Load host pages into device pages and return once every rank has
        them (True) or the load failed on some rank (False), as agreed."""
        self.take_reply()
        if self.host.prefix(pages) < len(pages):
            # The step that was in flight when the pages were matched evicted
            # some of them: known alike on every rank, so a failure like any.
            self.tally.loads += 1
            self.tally.load_failures += 1
            return False
        ended: list[bool] = []
        self.load(pages, device_pages, done=ended.append)
        deadline = time.monotonic() + self.decision_timeout_s
        # Writes queued since this iteration's step wait for the next one: on
        # an overlapping scheduler their KV (a chunk just launched) may not be
        # computed yet, and their step is where the scheduler has synchronized.
        held = self.hold_writes()
        try:
            while not ended:
                if time.monotonic() > deadline:
                    raise Unavailable(f"load of {len(pages)} pages not decided in {self.decision_timeout_s} s")
                self.flush()
        finally:
            self.release_writes(held)
        return ended[0]

    def drain_writes(self) -> None:
        """Step until every write a step carried is decided: only then may
        their device pages be freed (the daemon may still be copying them)."""
        self.take_reply()
        deadline = time.monotonic() + self.decision_timeout_s
        while self._writes:
            if time.monotonic() > deadline:
                raise Unavailable(f"{len(self._writes)} writes not decided in {self.decision_timeout_s} s")
            self.flush()

    def load_opened(self, pages: list[bytes], device_pages: list[int], signals: LoadSignals,
                    done: Landed | None = None) -> tuple[int, int] | None:
        """Load host pages into device pages, this rank's copy publishing its
        layers on `signals` as they land, and return once the load's round
        has opened it on every rank: -> (op id, signal slot); every rank's
        copy has started, and `done(landed)` follows with the reply that
        decides it (unless that was this one). None: no slot was free
        (nothing sent), or the round ended the load (refused, or failed
        everywhere it ran: no copy of it runs any more)."""
        self.take_reply()
        if self.host.prefix(pages) < len(pages):
            self.tally.loads += 1  # evicted by the step in flight since the match: a failure like any
            self.tally.load_failures += 1
            return None
        queued = self.load_signalled(pages, device_pages, signals)
        if queued is None:
            return None
        op, slot = queued
        held = self.hold_writes()  # as in load_now: writes queued since this iteration's step wait for the next
        try:
            reply = self.flush()
        finally:
            self.release_writes(held)
        if op in reply.load_failures:
            return None
        if op in self._loads:
            self._loads[op] = (len(pages), done)
        elif done is not None:
            done(True)
        return op, slot
