"""The agreement engine: one dedicated thread runs every collective, in round
order.

The event loop packs a round (`rounds.RoundInput.pack`) and hands it over
with `submit`, getting a `concurrent.futures.Future` back. The thread reduces,
decodes and resolves the future. Any failure of a round (a lost peer, a crash
of the thread itself) breaks the engine: every pending and later round fails
with the same `Unavailable` error, in bounded time. Nothing is left waiting.

Closing the engine ends its epoch: gloo cannot interrupt a collective that
waits, so `close` lets the round in progress end (a peer completes it, or
its timeout fails it), delivers it as it ended (a completed round is agreed:
the peers that completed it apply it, and the daemon applies it too before
it leaves the epoch), joins the thread and only then destroys the groups.

A round that fails here may have completed on a peer (gloo ends a collective
on each rank apart: a rank timed out at the very edge, or frozen across its
timeout, while the others completed it). Before it fails the round, the
engine asks its peers through the rendezvous store
(`witness.RoundWitness`): a peer's reduced vector for the round is delivered
here as the round's result, exactly as the peers apply it, and the engine
breaks all the same. Nothing of this costs the rounds that complete: the
last one is kept in memory only.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cpcache.agreement.divergence import DivergenceExchange
from cpcache.agreement.rounds import MIN_CAPACITY, RoundInput, RoundResult
from cpcache.errors import CacheError, Divergence, PeerLost, Unavailable
from cpcache.histogram import Histogram

if TYPE_CHECKING:
    from cpcache.agreement.collective import Reducer
    from cpcache.agreement.liveness import Diagnosis, Heartbeat
    from cpcache.agreement.witness import RoundWitness

log = logging.getLogger(__name__)


# Round durations (collective time, including waiting for peers), written by
# the agreement thread only.
ROUND_BOUNDS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class RoundFaults:
    """Per-rank perturbation of round timing, for tests and demos."""

    delay_ms: float = 0.0  # each round waits uniform(0, delay_ms) before reducing
    seed: int = 0
    lost_after_complete: int = 0  # this round completes, and is then reported as timed out (0: none)


@dataclass(frozen=True)
class Recovered:
    """A round that failed here completed on peer `rank`: its reduced vector,
    and the failure the engine breaks with once it is delivered."""

    rank: int
    vector: np.ndarray
    failure: CacheError


class AgreementEngine:
    def __init__(
        self,
        reducer: Reducer,
        exchange: DivergenceExchange | None,
        diagnose: Callable[[int, BaseException], CacheError | Recovered],
        heartbeat: Heartbeat | None = None,
        faults: RoundFaults = RoundFaults(),
        on_failure: Callable[[CacheError], object] | None = None,
        witness: RoundWitness | None = None,
    ) -> None:
        """`reducer` has `min_inplace(vector)` and `close()`; `diagnose(round,
        exc)` returns a `PeerLost` naming the missing ranks, or the round as
        a peer completed it (`Recovered`); `on_failure(error)` is called
        once, from the agreement thread, when the engine breaks; `witness`
        keeps the last completed round for peers whose round failed."""
        self._reducer = reducer
        self._exchange = exchange
        self._diagnose = diagnose
        self._heartbeat = heartbeat
        self._faults = faults
        self._on_failure = on_failure
        self._witness = witness
        self._random = random.Random(faults.seed)
        self._jobs: queue.SimpleQueue[tuple[RoundInput, Future] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._failure: CacheError | None = None
        self._closed = False
        self._closed_why = "the agreement engine is closed: the daemon is shutting down"
        self.rounds_completed = 0
        self.rounds_recovered = 0  # failed here, completed on a peer, delivered as there
        self.divergences = 0
        self.round_latency = Histogram(ROUND_BOUNDS_S)
        self._capacity = MIN_CAPACITY  # touched only by the agreement thread
        self._reducer_open = True
        self._thread = threading.Thread(target=self._run, name="agreement", daemon=True)
        self._thread.start()

    @property
    def failure(self) -> CacheError | None:
        return self._failure

    def submit(self, round_input: RoundInput) -> Future:
        future: Future = Future()
        with self._lock:
            if self._failure is not None:
                future.set_exception(self._failure)
            elif self._closed:
                future.set_exception(Unavailable(self._closed_why))
            else:
                self._jobs.put((round_input, future))
        return future

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float | None = None, why: str | None = None) -> bool:
        """End the engine: rounds not yet started fail with `Unavailable`
        (`why`), the one in its collective ends as it ends (delivered if it
        completed, as it is on the peers that completed it); the
        thread is joined (untimed by default: a collective waits at most its
        own timeout), then the groups are destroyed. True once they are.
        Safe to call twice."""
        with self._lock:
            if not self._closed:
                self._closed = True
                if why:
                    self._closed_why = why
                self._jobs.put(None)
        self._fail_pending(Unavailable(self._closed_why))
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        with self._lock:
            reducer, self._reducer_open = self._reducer_open, False
        if reducer:
            self._reducer.close()
        return True

    def _run(self) -> None:
        try:
            self._rounds()
        finally:
            if self._witness is not None:
                self._witness.ended()

    def _rounds(self) -> None:
        while (job := self._jobs.get()) is not None:
            round_input, future = job
            # A cancelled caller still gets its round run: peers wait in it.
            if not future.set_running_or_notify_cancel():
                future = Future()
            try:
                self._one_round(round_input, future)
            except BaseException as exc:  # the thread must never die silently, nor strand a caller
                log.exception("agreement thread crashed in round %d", round_input.number)
                failure = Unavailable(f"the agreement thread crashed in round {round_input.number}: "
                                      f"{type(exc).__name__}: {exc}")
                if not future.done():
                    future.set_exception(failure)
                self._break(failure)
                return

    def _one_round(self, round_input: RoundInput, future: Future) -> None:
        if self._failure is not None:
            future.set_exception(self._failure)
            return
        if self._closed:  # submitted before the close, not yet begun: never begun
            future.set_exception(Unavailable(self._closed_why))
            return
        if self._heartbeat is not None:
            self._heartbeat.entered(round_input.number)
        if self._faults.delay_ms:
            time.sleep(self._random.uniform(0, self._faults.delay_ms) / 1000)
        if round_input.rejection is not None and self._exchange is not None:
            try:
                self._exchange.publish_rejection(round_input.number, round_input.rejection.message)
            except Exception:  # the reason is lost, the round still runs: peers are waiting in it
                log.warning("could not publish why round %d was rejected", round_input.number, exc_info=True)
        started = time.perf_counter()
        try:
            vector, self._capacity = round_input.reduce(self._reducer.min_inplace, self._capacity)
            if round_input.number == self._faults.lost_after_complete:
                log.error("fault injection: round %d completed, reported as timed out", round_input.number)
                raise RuntimeError(f"fault injection: round {round_input.number} completed here and is reported "
                                   f"as timed out")
        except RuntimeError as exc:
            recovered = self._failed(round_input, exc, future)
            if recovered is None:
                return
            self._deliver(round_input, recovered.vector, future)
            self._break(recovered.failure)
            return
        if self._witness is not None:
            self._witness.completed(round_input.number, vector)
        self.rounds_completed += 1
        self.round_latency.observe(time.perf_counter() - started)
        self._deliver(round_input, vector, future)

    def _failed(self, round_input: RoundInput, exc: RuntimeError, future: Future) -> Recovered | None:
        """Round `round_input` failed here: what a peer completed of it, or
        None once it is failed (and the engine broken)."""
        if self._witness is not None:
            self._witness.failed()
        outcome = self._diagnose(round_input.number, exc)
        if isinstance(outcome, Recovered):
            if round_input.holds(outcome.vector):
                self.rounds_recovered += 1
                if self._witness is not None:
                    self._witness.completed(round_input.number, outcome.vector)
                return outcome
            log.error("round %d: rank %d's result does not hold this rank's values; it is not applied",
                      round_input.number, outcome.rank)
            outcome = outcome.failure
        self._break(outcome)
        future.set_exception(outcome)
        return None

    def _deliver(self, round_input: RoundInput, vector: np.ndarray, future: Future) -> None:
        """Resolve `future` with the completed round's result."""
        # Closed while this round was in its collective: it completed, so it
        # is agreed (a peer may already apply it) and is delivered all the
        # same; whoever closed decides whether it still applies it.
        try:
            result = round_input.decode(vector)
        except Divergence:
            self.divergences += 1
            message = f"divergence in round {round_input.number}"
            if self._exchange is not None:
                try:
                    message = self._exchange.explain(round_input)
                except Exception as exc:  # a report that cannot be read still fails the step, loudly
                    message += f" (the ranks' reports could not be compared: {exc})"
            future.set_exception(Divergence(message, round_input.number))
            return
        if result.rejection is not None:
            result = self._with_rejection_message(round_input, result)
        future.set_result(result)

    def _with_rejection_message(self, round_input: RoundInput, result: RoundResult) -> RoundResult:
        rejection = result.rejection
        assert rejection is not None  # the caller checked
        if round_input.rejection is not None and round_input.rejection.rank == rejection.rank:
            message = round_input.rejection.message
        elif self._exchange is not None:
            message = self._exchange.rejection_message(round_input.number, rejection.rank)
        else:
            message = ""
        return dataclasses.replace(result, rejection=dataclasses.replace(rejection, message=message))

    def _break(self, failure: CacheError) -> None:
        with self._lock:
            first = self._failure is None
            if self._failure is None:
                self._failure = failure
            recorded = self._failure
        self._fail_pending(recorded)
        if first:
            log.error("agreement broken: %s", failure)
            if self._on_failure is not None:
                self._on_failure(failure)

    def _fail_pending(self, failure: CacheError) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:
                # The close sentinel stays last in the queue: the thread must
                # still read it to end (and let the groups be destroyed).
                self._jobs.put(None)
                return
            if not job[1].done():
                job[1].set_exception(failure)


def peer_lost(round_number: int, exc: BaseException, diagnosis: Diagnosis) -> PeerLost:
    return PeerLost(
        f"round {round_number} failed: {diagnosis.reason}; the agreement domain cannot decide "
        f"until it is restarted in a new epoch (gloo: {str(exc).splitlines()[0][:200]})",
        diagnosis.missing,
    )

