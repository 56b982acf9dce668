"""Agreement rounds as plain data: the open-questions table, how a round's
local answers are packed into one int64 vector, and how the reduced vector is
read back (DESIGN section 4).

A round's vector is ``[fp, -fp, digest, -digest, answer_0, answer_1, ...]``,
reduced with MIN. ``min(x) == -min(-x)`` holds only when every rank sent the
same x, so slots 0..3 detect a different question set or shared state. MAX
questions travel negated. Nothing here does I/O or touches threads.
"""

from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass, field

import numpy as np

from cpcache.errors import Divergence, FailedPrecondition, InvalidArgument

HEADER_SLOTS = 4
# Fingerprints and digests are kept below 2**62 so that negation never overflows.
_HASH_MASK = (1 << 62) - 1
INT64_MAX = (1 << 63) - 1


class Reduce(enum.IntEnum):
    MIN = 1
    MAX = 2


class Kind(enum.IntEnum):
    """What a question asks. Part of the fingerprint."""

    VOTE = 1  # a scheduler-supplied value, answered in the round that opens it


@dataclass(frozen=True, order=True)
class QuestionKey:
    op_id: int
    kind: Kind


@dataclass
class Question:
    key: QuestionKey
    reduce: Reduce
    local: int
    one_shot: bool = False  # closed as soon as it has been put in a round

    def packed(self) -> int:
        return self.local if self.reduce is Reduce.MIN else -self.local


def hash62(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _HASH_MASK


def check_value(value: int, what: str) -> int:
    if not -INT64_MAX <= value <= INT64_MAX:
        raise InvalidArgument(f"{what} {value} is outside the int64 range (-2**63, 2**63)")
    return value


@dataclass(frozen=True)
class RoundInput:
    """One rank's contribution to round `number`."""

    number: int
    keys: tuple[QuestionKey, ...]
    reduces: tuple[Reduce, ...]
    fingerprint: int
    digest: int
    vector: np.ndarray

    def description(self) -> bytes:
        """What this rank asked, for naming differences after a divergence."""
        return json.dumps(
            {
                "fingerprint": self.fingerprint,
                "digest": self.digest,
                "questions": [[k.op_id, int(k.kind), int(r)] for k, r in zip(self.keys, self.reduces)],
            }
        ).encode()

    def settle(self, reduced: np.ndarray) -> RoundResult:
        """Read the reduced vector. Raises `Divergence` (without rank names:
        see `explain_divergence`) when ranks sent different headers."""
        same_questions = reduced[0] == -reduced[1]
        same_state = reduced[2] == -reduced[3]
        if not (same_questions and same_state):
            raise Divergence(f"round {self.number}: ranks disagree")
        values = reduced[HEADER_SLOTS:].tolist()
        answers = {
            key: (value if reduce is Reduce.MIN else -value)
            for key, reduce, value in zip(self.keys, self.reduces, values)
        }
        return RoundResult(number=self.number, digest=self.digest, answers=answers)


@dataclass(frozen=True)
class RoundResult:
    """What every rank of the domain agreed in one round."""

    number: int
    digest: int
    answers: dict[QuestionKey, int]


@dataclass
class QuestionTable:
    """The open questions of this rank. Opened and closed only by scheduler
    calls and agreed results, so it is identical on every rank."""

    questions: dict[QuestionKey, Question] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.questions)

    def open(self, question: Question) -> None:
        if question.key in self.questions:
            raise FailedPrecondition(
                f"operation {question.key.op_id} already has an open {question.key.kind.name.lower()} question"
            )
        check_value(question.local, f"local answer of operation {question.key.op_id}")
        self.questions[question.key] = question

    def update(self, key: QuestionKey, local: int) -> None:
        self.questions[key].local = check_value(local, f"local answer of operation {key.op_id}")

    def close(self, key: QuestionKey) -> None:
        self.questions.pop(key, None)

    def pack(self, number: int, digest: int) -> RoundInput:
        """Freeze the local answers of every open question into round `number`
        and close the one-shot questions it carries."""
        ordered = sorted(self.questions.values(), key=lambda q: q.key)
        keys = tuple(q.key for q in ordered)
        reduces = tuple(q.reduce for q in ordered)
        shape = np.array(
            [number] + [x for q in ordered for x in (q.key.op_id, q.key.kind, q.reduce)], dtype=np.int64
        )
        fingerprint = hash62(shape.tobytes())
        digest &= _HASH_MASK
        vector = np.empty(HEADER_SLOTS + len(ordered), dtype=np.int64)
        vector[:HEADER_SLOTS] = (fingerprint, -fingerprint, digest, -digest)
        vector[HEADER_SLOTS:] = [q.packed() for q in ordered]
        for q in ordered:
            if q.one_shot:
                del self.questions[q.key]
        return RoundInput(number, keys, reduces, fingerprint, digest, vector)


def explain_divergence(number: int, by_rank: dict[int, bytes | None]) -> str:
    """Name the ranks and operations that differ, from every rank's
    `RoundInput.description()` (None for a rank that did not report)."""
    silent = sorted(r for r, d in by_rank.items() if d is None)
    reports = {r: json.loads(d) for r, d in by_rank.items() if d is not None}
    parts = [f"divergence in round {number}"]
    question_sets = {r: {tuple(q) for q in rep["questions"]} for r, rep in reports.items()}
    every = set().union(*question_sets.values()) if question_sets else set()
    for question in sorted(every):
        holders = sorted(r for r, qs in question_sets.items() if question in qs)
        if len(holders) != len(question_sets):
            op_id, kind, reduce = question
            others = sorted(set(question_sets) - set(holders))
            parts.append(
                f"operation {op_id} ({Kind(kind).name.lower()}, {Reduce(reduce).name}) "
                f"asked by ranks {holders} but not by ranks {others}"
            )
    by_digest: dict[int, list[int]] = {}
    for rank, rep in sorted(reports.items()):
        by_digest.setdefault(rep["digest"], []).append(rank)
    if len(by_digest) > 1:
        listing = "; ".join(f"ranks {ranks} have {digest:#x}" for digest, ranks in by_digest.items())
        parts.append(f"shared-state digests differ: {listing}")
    if len(parts) == 1 and len(reports) > 1:
        parts.append("question sets differ in step number or reduction")
    if silent:
        parts.append(f"ranks {silent} did not report their questions")
    return "; ".join(parts)
