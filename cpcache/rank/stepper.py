"""One rank's view of the scheduler protocol: steps in, agreed decisions out.

The coordinator is touched only from the event loop. It checks step order,
opens the step's operations in the shared state, packs one round per step
(whatever happened locally: no path skips a round), hands it to the agreement
engine and applies the round `agreement_lag` steps back.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

import numpy as np

from cpcache.agreement.engine import AgreementEngine
from cpcache.rank.assembly import CacheRuntime
from cpcache.state.machine import Decisions, StepOps, check_step_allowed
from cpcache.errors import FailedPrecondition, InvalidArgument
from cpcache.agreement.kinds import VOTE
from cpcache.agreement.rounds import Questions, RoundInput, RoundResult
from cpcache.hashing import hash62

MAX_VOTES_PER_STEP = 1 << 16


@dataclass(frozen=True)
class StepOutcome:
    step: int
    round: int  # the step whose round this carries; 0 while the pipeline fills
    op_ids: np.ndarray  # decided votes, by op id
    values: np.ndarray  # their agreed values
    digest: int
    cache: Decisions = field(default_factory=Decisions)


class Coordinator:
    def __init__(self, engine: AgreementEngine, agreement_lag: int = 0) -> None:
        if agreement_lag < 0:
            raise InvalidArgument(f"agreement_lag must be >= 0, got {agreement_lag}")
        self._engine = engine
        self._lag = agreement_lag
        self._in_flight: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self._applied_chain = 0  # hash chain of every agreed vote result applied here
        self.cache: CacheRuntime | None = None
        self.last_step = 0
        self.decision_count = 0

    @property
    def open_questions(self) -> int:
        """Questions that stay open across rounds (votes close in their own)."""
        return self.cache.state.open_questions() if self.cache else 0

    @property
    def digest(self) -> int:
        """Digest of the shared state: identical on every rank of the domain."""
        if self.cache is None:
            return self._applied_chain
        return hash62(np.array([self._applied_chain, self.cache.state.digest], dtype=np.int64).tobytes())

    async def step(self, step: int, votes: Questions, ops: StepOps = StepOps()) -> StepOutcome:
        # Everything up to the submit is synchronous, so rounds are submitted
        # in the order steps arrive, and a rejected step changes nothing.
        if step <= self.last_step:
            raise FailedPrecondition(
                f"step {step} is not after the last step {self.last_step}: steps must strictly increase"
            )
        if len(votes) > MAX_VOTES_PER_STEP:
            raise InvalidArgument(f"a step carries at most {MAX_VOTES_PER_STEP} votes, got {len(votes)}")
        check_step_allowed(self.cache is not None, ops)
        questions = votes
        decided = Decisions()
        if self.cache is not None:
            intents, decided = self.cache.state.open_step(step, ops)
            self.cache.io.start(intents)
            questions = questions.concat(self.cache.state.questions(self.cache.io))
        self.last_step = step
        round_input = RoundInput.pack(step, questions, self.digest)
        future = asyncio.wrap_future(self._engine.submit(round_input))
        self._in_flight.append((step, future))
        if len(self._in_flight) <= self._lag:
            empty = np.empty(0, dtype=np.int64)
            return StepOutcome(step, 0, empty, empty, self.digest, decided)
        round_number, oldest = self._in_flight.popleft()
        # Shielded: a cancelled RPC must never cancel a round, or this rank
        # would skip a collective its peers are waiting in.
        result = await asyncio.shield(oldest)
        outcome = self._apply(round_number, result)
        outcome.cache.merge(decided)
        return outcome

    def _apply(self, round_number: int, result: RoundResult) -> StepOutcome:
        op_ids, values = result.of_kind(VOTE.code)
        chain = np.array([self._applied_chain, result.number], dtype=np.int64)
        self._applied_chain = hash62(chain.tobytes() + op_ids.tobytes() + values.tobytes())
        decisions = Decisions()
        if self.cache is not None:
            decisions, intents = self.cache.state.apply(result)
            self.cache.io.start(intents)
            self.cache.io.forget(decisions)
        self.decision_count += len(op_ids) + count_decisions(decisions)
        return StepOutcome(self.last_step, round_number, op_ids, values, result.digest, decisions)


def count_decisions(decisions: Decisions) -> int:
    return sum(len(v) for v in vars(decisions).values())
