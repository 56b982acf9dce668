"""Open operations, one class per kind. Each owns its lifecycle: the
questions it asks each round (with this rank's local answers) and what it
does with the agreed answers. Opening and the shared bookkeeping they touch
(index, allocator) live in `CacheState`; an operation only asks and settles.

Operations are keyed by a serial the state hands out when it opens them:
unique for the life of the state and never reused, so an answer can only
ever reach the operation it was asked about, whatever the lag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from cpcache.agreement.kinds import QuestionKind
from cpcache.state.intents import Decisions, Intent
from cpcache.state.questions import (
    BACKUP_OUTCOME,
    LOAD_OUTCOME,
    NOT_YET,
    PREFETCH_DONE,
    PREFETCH_HIT,
    PREFETCH_MAY_END,
    RECLAIM,
    WRITE_OUTCOME,
    BackupOutcome,
    Outcome,
)
from cpcache.state.requests import LoadRequest, PrefetchRequest, WriteRequest

if TYPE_CHECKING:
    from cpcache.state.machine import CacheState

Asked = list[tuple[QuestionKind, int]]


class LocalProgress(Protocol):
    """This rank's I/O progress by operation serial, read when a round is packed."""

    def exists(self, serial: int) -> int: ...  # NOT_YET until known

    def fetched(self, serial: int) -> int: ...  # pages done, from the first

    def fetch_ended(self, serial: int) -> bool: ...

    def elapsed_s(self, serial: int) -> float: ...

    def write_outcome(self, serial: int) -> Outcome: ...

    def backup_outcome(self, serial: int) -> BackupOutcome: ...

    def load_outcome(self, serial: int) -> Outcome: ...

    def idle(self, slots: list[int]) -> bool: ...


class Operation:
    serial: int

    def label(self) -> str:
        raise NotImplementedError

    def ask(self, state: CacheState, local: LocalProgress) -> Asked:
        raise NotImplementedError

    def settle(self, state: CacheState, answers: dict[int, int], decisions: Decisions) -> list[Intent]:
        raise NotImplementedError


@dataclass
class Prefetch(Operation):
    serial: int
    request: PrefetchRequest
    hit: int = NOT_YET  # agreed storage hit; NOT_YET while being asked
    slots: list[int] = field(default_factory=list)
    polled_at: int = 0  # the step of the scheduler's latest poll (0: none pending)

    def label(self) -> str:
        return f"prefetch {self.request.op_id}"

    def ask(self, state: CacheState, local: LocalProgress) -> Asked:
        if self.hit == NOT_YET:
            return [(PREFETCH_HIT, local.exists(self.serial))]
        if not self.polled_at:
            return []
        done = local.fetched(self.serial)
        complete = done >= self.hit or local.fetch_ended(self.serial)
        may_end = state.prefetch_policy.may_end(complete, local.elapsed_s(self.serial), self.request.tokens)
        return [(PREFETCH_DONE, done), (PREFETCH_MAY_END, int(may_end))]

    def settle(self, state: CacheState, answers: dict[int, int], decisions: Decisions) -> list[Intent]:
        hit = answers.get(PREFETCH_HIT.code, NOT_YET)
        if hit != NOT_YET and self.hit == NOT_YET:
            return state.decide_hit(self, hit, decisions)
        if answers.get(PREFETCH_MAY_END.code) == 1:
            state.end_prefetch(self, answers[PREFETCH_DONE.code], decisions)
        elif PREFETCH_MAY_END.code in answers and state.round > self.polled_at:
            self.polled_at = 0  # not yet, and asked after the latest poll: the scheduler polls again
        return []


@dataclass
class Write(Operation):
    serial: int
    request: WriteRequest
    new: list[int]  # indexes into request.pages that were not resident when it opened
    slots: list[int]

    def label(self) -> str:
        return f"write {self.request.op_id}"

    def ask(self, state: CacheState, local: LocalProgress) -> Asked:
        return [(WRITE_OUTCOME, local.write_outcome(self.serial))]

    def settle(self, state: CacheState, answers: dict[int, int], decisions: Decisions) -> list[Intent]:
        outcome = answers.get(WRITE_OUTCOME.code, Outcome.PENDING)
        if outcome == Outcome.OK:
            state.ack_write(self, decisions)
        elif outcome == Outcome.FAILED:
            state.fail_write(self, decisions)
        return []


@dataclass
class Backup(Operation):
    serial: int
    pages: list[bytes]

    def label(self) -> str:
        return f"backup {self.serial}"

    def ask(self, state: CacheState, local: LocalProgress) -> Asked:
        return [(BACKUP_OUTCOME, local.backup_outcome(self.serial))]

    def settle(self, state: CacheState, answers: dict[int, int], decisions: Decisions) -> list[Intent]:
        outcome = answers.get(BACKUP_OUTCOME.code, BackupOutcome.PENDING)
        if outcome != BackupOutcome.PENDING:
            state.end_backup(self, BackupOutcome(outcome), decisions)
        return []


@dataclass
class Load(Operation):
    serial: int
    request: LoadRequest
    slots: list[int]

    def label(self) -> str:
        return f"load {self.request.op_id}"

    def ask(self, state: CacheState, local: LocalProgress) -> Asked:
        return [(LOAD_OUTCOME, local.load_outcome(self.serial))]

    def settle(self, state: CacheState, answers: dict[int, int], decisions: Decisions) -> list[Intent]:
        outcome = answers.get(LOAD_OUTCOME.code, Outcome.PENDING)
        if outcome != Outcome.PENDING:
            state.end_load(self, Outcome(outcome), decisions)
        return []


@dataclass
class Retirement(Operation):
    """Host slots given up by their owner, back to the allocator once no
    rank has I/O on them (DESIGN rule 5)."""

    serial: int
    slots: list[int]

    def label(self) -> str:
        return f"retirement {self.serial}"

    def ask(self, state: CacheState, local: LocalProgress) -> Asked:
        return [(RECLAIM, int(local.idle(self.slots)))]

    def settle(self, state: CacheState, answers: dict[int, int], decisions: Decisions) -> list[Intent]:
        if answers.get(RECLAIM.code) == 1:
            state.reclaim(self)
        return []
