"""One rank's view of the scheduler protocol: steps in, agreed decisions out.

The coordinator is touched only from the event loop. It checks step order,
opens the step's questions, packs one round per step (whatever happened
locally: no path skips a round), hands it to the agreement engine and returns
the decisions of the round `agreement_lag` steps back.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

from cpcache.agreement import AgreementEngine
from cpcache.errors import FailedPrecondition, InvalidArgument
from cpcache.rounds import INT64_MAX, Kind, Question, QuestionKey, QuestionTable, Reduce, RoundResult, hash62

MAX_VOTES_PER_STEP = 1 << 16


@dataclass(frozen=True)
class Vote:
    """A scheduler question answered in the round of its step."""

    op_id: int
    reduce: Reduce
    value: int


@dataclass(frozen=True)
class StepOutcome:
    step: int
    round: int  # the step whose round this carries; 0 while the pipeline fills
    decisions: tuple[tuple[int, int], ...]  # (op_id, agreed value), by op id
    digest: int


def check_votes(votes: list[Vote]) -> None:
    if len(votes) > MAX_VOTES_PER_STEP:
        raise InvalidArgument(f"a step carries at most {MAX_VOTES_PER_STEP} votes, got {len(votes)}")
    seen: set[int] = set()
    for vote in votes:
        if not 0 <= vote.op_id <= INT64_MAX:
            raise InvalidArgument(f"op id {vote.op_id} is outside [0, 2**63)")
        if vote.op_id in seen:
            raise InvalidArgument(f"op id {vote.op_id} appears twice in one step")
        seen.add(vote.op_id)


class Coordinator:
    def __init__(self, engine: AgreementEngine, agreement_lag: int = 0) -> None:
        if agreement_lag < 0:
            raise InvalidArgument(f"agreement_lag must be >= 0, got {agreement_lag}")
        self._engine = engine
        self._lag = agreement_lag
        self._table = QuestionTable()
        self._in_flight: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self._applied_chain = 0  # hash chain of every agreed result applied here
        self.last_step = 0

    @property
    def open_questions(self) -> int:
        return len(self._table)

    @property
    def digest(self) -> int:
        """Digest of the shared state: identical on every rank of the domain."""
        return self._applied_chain

    async def step(self, step: int, votes: list[Vote]) -> StepOutcome:
        # Everything up to the submit is synchronous, so rounds are submitted
        # in the order steps arrive, and a bad request changes nothing.
        if step <= self.last_step:
            raise FailedPrecondition(
                f"step {step} is not after the last step {self.last_step}: steps must strictly increase"
            )
        check_votes(votes)
        for vote in votes:
            self._table.open(Question(QuestionKey(vote.op_id, Kind.VOTE), vote.reduce, vote.value, one_shot=True))
        self.last_step = step
        round_input = self._table.pack(step, self.digest)
        future = asyncio.wrap_future(self._engine.submit(round_input))
        self._in_flight.append((step, future))
        if len(self._in_flight) <= self._lag:
            return StepOutcome(step=step, round=0, decisions=(), digest=self.digest)
        round_number, oldest = self._in_flight.popleft()
        # Shielded: a cancelled RPC must never cancel a round, or this rank
        # would skip a collective its peers are waiting in.
        result = await asyncio.shield(oldest)
        return StepOutcome(step=step, round=round_number, decisions=self._apply(result), digest=result.digest)

    def _apply(self, result: RoundResult) -> tuple[tuple[int, int], ...]:
        decisions = tuple((key.op_id, value) for key, value in result.answers.items() if key.kind is Kind.VOTE)
        self._applied_chain = hash62(repr((self._applied_chain, result.number, decisions)).encode())
        return decisions
