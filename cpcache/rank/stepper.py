"""One rank's view of the scheduler protocol: steps in, agreed decisions out
(docs/design.md rules 6 to 9).

- Every step enters its round, whatever happens locally. A step this rank
  refuses enters it as a rejection; a round that any rank rejected, or that
  diverged, opens nothing anywhere and changes no state.
- A step's operations open when its round agreed that every rank took the
  step: that is, when the round is applied, in round order, by a task the
  RPC only waits on. A cancelled or timed-out call changes nothing about
  what is decided or applied.
- Round n is applied right before round n + lag is packed (with lag 0: right
  after it completes), so every rank packs every round against the same
  state.
- What a step answers leaves before the work its answer does not need:
  at lag >= 1 the answer (an earlier round's) is given before the step's
  own round is packed and handed to the agreement thread; at any lag the
  round's I/O other than loads starts after the answer (and always before
  the next round is packed), so the I/O threads it wakes do not compete
  with the loop while it applies and replies.
- `step` is idempotent by step number: a retry gets the same outcome while
  it is among the last `REPLIES_KEPT` steps.
- A stepper decides in one epoch. Leaving it closes its engine first, then
  lets the steps already taken end (`finish_in_flight`): a round the step
  carries that completed is applied, as on the peers that completed it, so
  at lag 0 every rank answers such a step alike (at lag >= 1 a completed
  round still waiting in the pipeline for its carrying step is not); once
  left (`leave`), nothing more is applied and no I/O starts.

What a round does to the cache is `CacheRuntime`'s (rank/runtime.py: check,
pack, `apply_round`), the one copy the replica harness also runs; the
stepper keeps the order, the lag and the tasks.

Touched only from the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from cpcache.agreement.engine import AgreementEngine
from cpcache.agreement.kinds import VOTE
from cpcache.agreement.rounds import Questions, RoundInput, RoundResult
from cpcache.errors import (
    CacheError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    RejectedByPeer,
    StepOrder,
    Unavailable,
)
from cpcache.hashing import hash62
from cpcache.rank.phases import StepPhases
from cpcache.rank.runtime import AppliedRound, CacheRuntime, describe
from cpcache.requests import CacheRequests
from cpcache.state.intents import Decisions, Intent
from cpcache.values import ID_LIMIT

log = logging.getLogger(__name__)

MAX_VOTES_PER_STEP = 1 << 16
REPLIES_KEPT = 64
FENCED = -1  # the request digest of a step failed before this rank took it: any retry gets the failure


@dataclass(frozen=True)
class StepAnswer:
    step: int
    round: int  # the step whose round this carries; 0 while the pipeline fills
    op_ids: np.ndarray  # decided votes, by op id
    values: np.ndarray  # their agreed values
    digest: int
    decided: Decisions = field(default_factory=Decisions)
    epoch: int = 0  # the epoch of the stepper that answered


@dataclass
class _Submitted:
    """A round on its way, and what its step carried."""

    number: int
    requests: CacheRequests | None  # None when this rank rejected the step
    round: asyncio.Future
    rejection: CacheError | None  # this rank's own reason


class Stepper:
    def __init__(self, engine: AgreementEngine, rank: int = 0, agreement_lag: int = 0, epoch: int = 0) -> None:
        """`agreement_lag`: as `DaemonConfig` checked it (>= 0)."""
        self._engine = engine
        self._rank = rank
        self._lag = agreement_lag
        self._pipeline: collections.deque[_Submitted] = collections.deque()
        self._replies: collections.OrderedDict[int, tuple[int, asyncio.Future]] = collections.OrderedDict()
        self._tail: asyncio.Future | None = None  # the latest step's task: the next one starts after it
        self._applied_chain = 0  # hash chain of every agreed vote result applied here
        self.epoch = epoch  # the domain epoch this stepper decides in (one stepper per epoch)
        self._left: str | None = None  # why this stepper's epoch was left
        self.runtime: CacheRuntime | None = None
        self.last_step = 0
        self.decision_count = 0
        self.rejected_steps = 0
        self.phases = StepPhases()  # where this rank's steps spend their time
        # Called with each step's number once its round is applied, before
        # it is answered (fault injection: a daemon dying in between).
        self.after_round: Callable[[int], None] | None = None
        # Told each step's outcome (epoch, step, outcome) before it is
        # answered: the daemon records it where its scheduler can read it.
        self.recorded: Callable[[int, int, StepAnswer | CacheError], None] | None = None

    def _record(self, step: int, outcome: StepAnswer | CacheError) -> None:
        if self.recorded is None:
            return
        try:
            self.recorded(self.epoch, step, outcome)
        except Exception:  # a record lost costs only the shortcut it offers
            log.exception("recording the outcome of step %d failed", step)

    def leave(self, why: str) -> None:
        """This stepper's epoch is over: nothing more is applied here."""
        self._left = why

    async def finish_in_flight(self) -> None:
        """Wait for the steps already taken to end, once their engine has
        closed (so each round either completed or failed): a round that
        completed is applied here as on every peer that completed it, and
        its I/O starts before the epoch's data plane drains."""
        if self._tail is not None and not self._tail.done():
            await asyncio.wait({self._tail})

    @property
    def deciding(self) -> bool:
        """Whether a step taken has not ended yet (its round, its answer)."""
        return self._tail is not None and not self._tail.done()

    @property
    def left(self) -> bool:
        return self._left is not None

    @property
    def open_questions(self) -> int:
        return self.runtime.open_questions() if self.runtime else 0

    @property
    def digest(self) -> int:
        """Digest of the shared state: identical on every rank of the domain."""
        if self.runtime is None:
            return self._applied_chain
        return hash62(np.array([self._applied_chain, self.runtime.digest], dtype=np.int64).tobytes())

    async def step(self, step: int, votes: Questions, requests: CacheRequests = CacheRequests(), *,
                   invalid: CacheError | None = None, request_digest: int = 0) -> StepAnswer:
        """Take step `step` (or answer a retry of it). `invalid`: the request
        could not even be read; the step still enters its round, rejected.
        `request_digest` tells a retry from a different step with the same number."""
        if not 0 < step < ID_LIMIT:
            raise InvalidArgument(f"step {step} is outside [1, 2**63)")
        if step <= self.last_step:
            return await self._retry(step, request_digest)
        self.last_step = step
        answer: asyncio.Future[StepAnswer] = asyncio.get_running_loop().create_future()
        answer.add_done_callback(_observe)
        task = asyncio.ensure_future(self._take(step, votes, requests, invalid, self._tail, answer))
        task.add_done_callback(_observe)
        self._tail = task
        self._replies[step] = (request_digest, answer)
        while len(self._replies) > REPLIES_KEPT:
            self._replies.popitem(last=False)
        # Shielded: the outcome belongs to the daemon, not to this call.
        return await asyncio.shield(answer)

    def fence(self, step: int, failure: CacheError) -> bool:
        """Fail step `step` here before this rank takes it, for good: a peer's
        scheduler whose daemon is gone asked how it ended (docs/design.md rule
        12). Its round can then complete nowhere (it needs this rank), so the
        peer's "not taken" is final; this rank's own scheduler, sending the
        step later, gets `failure` too. -> False when the step was taken (its
        kept answer decides) or the epoch was left (no later step is taken)."""
        if self._left is not None or step <= self.last_step:
            return False
        failed: asyncio.Future[StepAnswer] = asyncio.get_running_loop().create_future()
        failed.set_exception(failure)
        failed.add_done_callback(_observe)
        for fenced in range(max(self.last_step + 1, step - REPLIES_KEPT + 1), step + 1):
            self._replies[fenced] = (FENCED, failed)
            self._record(fenced, failure)
        self.last_step = step
        while len(self._replies) > REPLIES_KEPT:
            self._replies.popitem(last=False)
        return True

    def kept(self, step: int) -> asyncio.Future[StepAnswer]:
        """What step `step` answers on this rank (done once its round is
        applied), for a peer's scheduler whose own daemon never answered it:
        every rank answers a step alike. `NotFound` when this rank has not
        taken the step (no rank can have decided it: its round needs this
        one); `Unavailable` when it no longer keeps it."""
        kept = self._replies.get(step)
        if kept is None:
            if step > self.last_step:
                raise NotFound(f"rank {self._rank} has not taken step {step} of epoch {self.epoch} (its last is "
                               f"{self.last_step}): its round cannot be decided on any rank")
            raise Unavailable(f"rank {self._rank} keeps the last {REPLIES_KEPT} steps of epoch {self.epoch}, not "
                              f"step {step}")
        return kept[1]

    async def _retry(self, step: int, request_digest: int) -> StepAnswer:
        kept = self._replies.get(step)
        if kept is None:
            raise StepOrder(
                f"step {step} is not after the last step {self.last_step}, and is not among the last "
                f"{REPLIES_KEPT} steps this daemon remembers: send step {self.last_step + 1} or later",
                self.last_step)
        digest, task = kept
        if digest not in (request_digest, FENCED):
            raise FailedPrecondition(f"step {step} was already taken with different content; a retry must "
                                     f"repeat the request byte for byte")
        return await asyncio.shield(task)

    async def _take(self, step: int, votes: Questions, requests: CacheRequests, invalid: CacheError | None,
                    previous: asyncio.Future | None, answer: asyncio.Future[StepAnswer]) -> None:
        """Take the step: its round is submitted, whatever happens (peers
        wait in it), and `answer` gets what the step answers."""
        submitted = False
        try:
            if previous is not None:
                await asyncio.wait([previous])  # rounds are packed in step order
            if not self._lag:  # the step answers its own round
                self._submit(step, votes, requests, invalid)
                submitted = True
            carried: StepAnswer | CacheError | None = None  # None while the pipeline fills
            later: list[Intent] = []
            if self._pipeline and len(self._pipeline) >= self._lag:
                carried, later = await self._apply_guarded(self._pipeline.popleft())
            outcome = _outcome(step, carried, self.digest, self.epoch)
            self._record(step, outcome)  # before the answer leaves: readable after this daemon's death
            if self.after_round is not None:
                self.after_round(step)
            if not answer.done():  # done: its caller's loop is going away
                _settle(answer, outcome)
            # The answer leaves before the I/O it need not wait for starts and,
            # at lag >= 1, before this step's round is packed and the agreement
            # thread wakes up.
            await asyncio.sleep(0)
            self._start_later(later)
            if not submitted:
                self._submit(step, votes, requests, invalid)
                submitted = True
        except BaseException as exc:  # the loop is shutting down (cancelled), or a bug
            if not submitted:
                log.error("step %d ended before its round was submitted: %r", step, exc)
            if not answer.done():
                answer.set_exception(Unavailable(f"step {step} did not complete: {type(exc).__name__}"))
            raise

    def _submit(self, step: int, votes: Questions, requests: CacheRequests, invalid: CacheError | None) -> None:
        clock = self.phases.clock()
        rejection = invalid or self._refusal(votes, requests)
        clock.lap("check")
        round_input: RoundInput
        if rejection is None:
            try:
                round_input = self._pack(step, votes, requests)
            except Exception as exc:  # a bug while packing still enters the round, as a rejection
                log.exception("packing round %d failed", step)
                rejection = CacheError(f"internal error packing the step: {type(exc).__name__}: {exc}")
        if rejection is not None:
            self.rejected_steps += 1
            round_input = RoundInput.rejected(step, self._rank, rejection.status, str(rejection))
        clock.lap("pack")
        future = asyncio.wrap_future(self._engine.submit(round_input))
        self._pipeline.append(_Submitted(step, None if rejection else requests, future, rejection))
        clock.lap("submit")

    def _pack(self, step: int, votes: Questions, requests: CacheRequests) -> RoundInput:
        if self.runtime is None:
            return RoundInput.pack(step, votes, self.digest, requests.fingerprint(), {}, describe(requests))
        return self.runtime.pack(step, votes, self.digest, requests)

    def _refusal(self, votes: Questions, requests: CacheRequests) -> CacheError | None:
        """Why this rank refuses the step, or None. Never raises: a refusal
        is carried into the round, not thrown past it."""
        try:
            if len(votes) > MAX_VOTES_PER_STEP:
                raise InvalidArgument(f"a step carries at most {MAX_VOTES_PER_STEP} votes, got {len(votes)}")
            if self.runtime is None:
                if not requests.empty():
                    raise FailedPrecondition("no device pool is attached: call Attach before cache operations")
            else:
                # At lag >= 1 the state moves between the scheduler's view and its step's
                # round (an eviction the scheduler hears of later): a load that finds its pages
                # gone then fails alone, alike on every rank, when its step opens.
                in_pipeline = (s.requests for s in self._pipeline if s.requests is not None)
                self.runtime.check(requests, in_pipeline, loads_resident=not self._lag)
        except CacheError as exc:
            return exc
        except Exception as exc:  # a bug in a check still must not skip the round
            return CacheError(f"internal error checking the step: {type(exc).__name__}: {exc}")
        return None

    def _start(self, intents: list[Intent]) -> None:
        """Start this rank's I/O. The shared state has already changed: a
        failure here must not also skip the rest of the round."""
        assert self.runtime is not None
        try:
            self.runtime.start(intents)
        except Exception as exc:
            _never(exc)

    def _start_later(self, intents: list[Intent]) -> None:
        """The I/O a round asked for that its step's answer need not wait
        for, started once the answer has left: the I/O threads it wakes
        would otherwise take the interpreter from the loop while it applies
        and replies. Always before the next round is packed."""
        if intents:
            clock = self.phases.clock()
            self._start(intents)
            clock.lap("io_after_reply")

    async def _apply_guarded(self, submitted: _Submitted) -> tuple[StepAnswer | CacheError, list[Intent]]:
        try:
            return await self._apply(submitted)
        except Exception as exc:  # a bug applying a round: loud, and the next round still runs
            log.exception("applying round %d failed", submitted.number)
            return CacheError(f"internal error applying round {submitted.number}: {type(exc).__name__}: {exc}"), []

    async def _apply(self, submitted: _Submitted) -> tuple[StepAnswer | CacheError, list[Intent]]:
        """Apply one round, in round order: open its step's operations if
        every rank took it, then apply its answers. Returns what the step
        that carries it answers, and the I/O to start once it has answered
        (loads start at once: a scheduler may wait for one as soon as it is
        told that it opened)."""
        clock = self.phases.clock()
        try:
            result: RoundResult = await submitted.round
        except CacheError as exc:  # a divergence or a lost peer: nothing applied
            return exc, []
        finally:
            clock.lap("wait")
        if self._left is not None:
            return Unavailable(f"{self._left}: round {submitted.number} is not applied"), []
        if result.rejection is not None:
            if submitted.rejection is not None:
                return submitted.rejection, []
            r = result.rejection
            return RejectedByPeer(f"step {submitted.number} was rejected by rank {r.rank} ({r.status}): "
                                  f"{r.message}; nothing of it was opened on any rank",
                                  r.rank, submitted.number, r.status, r.message), []
        op_ids, values = result.of_kind(VOTE.code)
        chain = np.array([self._applied_chain, result.number], dtype=np.int64)
        self._applied_chain = hash62(chain.tobytes() + op_ids.tobytes() + values.tobytes())
        applied = AppliedRound()
        if self.runtime is not None:
            applied = self.runtime.apply_round(submitted.number, submitted.requests, result, self._start, clock)
        decided = applied.decided
        self.decision_count += len(op_ids) + decided.count()
        return StepAnswer(0, result.number, op_ids, values, result.digest, decided), applied.later


def _outcome(step: int, carried: StepAnswer | CacheError | None, digest: int, epoch: int
             ) -> StepAnswer | CacheError:
    """What step `step` answers, from the round it carries (None while the
    pipeline fills)."""
    if carried is None:
        empty = np.empty(0, dtype=np.int64)
        return StepAnswer(step, 0, empty, empty, digest, epoch=epoch)
    if isinstance(carried, CacheError):
        return carried
    return StepAnswer(step, carried.round, carried.op_ids, carried.values, carried.digest, carried.decided, epoch)


def _settle(answer: asyncio.Future[StepAnswer], outcome: StepAnswer | CacheError) -> None:
    if isinstance(outcome, CacheError):
        answer.set_exception(outcome)
    else:
        answer.set_result(outcome)


def _never(exc: BaseException) -> None:
    log.error("starting I/O failed; its operations stay pending here until the domain stops", exc_info=exc)


def _observe(task: asyncio.Future) -> None:
    """A step nobody waits for any more (its call was cancelled) still ends
    with an outcome; mark its exception seen."""
    if not task.cancelled():
        task.exception()
