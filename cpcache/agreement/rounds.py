"""Agreement rounds as plain data: the open-questions table, how a round's
local answers are packed into one int64 vector, and how the reduced vector is
read back (docs/design.md §4).

The questions of a round are derived from shared state each step (see
`cpcache.state.machine.CacheState.questions`) plus the step's one-shot votes.

A round's vector is ``[fp, -fp, digest, -digest, -count, -rejected,
rejecter, answer_0, ...]``, reduced with MIN. ``min(x) == -min(-x)`` holds
only when every rank sent the same x, so slots 0..3 detect a different
question set (or step content) or shared state. MAX questions travel negated.

A rank that rejects its step (docs/design.md rule 6) still enters the round, with
slot 5 set and slot 6 holding ``rank * 16 + status``: the reduced vector
names the lowest rejecting rank and its status, every rank reads the round
as rejected, and nothing else in it counts.

Ranks that diverged may hold different numbers of questions, and a collective
over tensors of different lengths cannot be allowed. So every round travels
at an agreed *capacity*: answers are padded with the MIN-neutral value to a
length every rank computed from the previous round's agreed count. When some
rank needs more room (slot 4 carries MAX of the counts), every rank sees it
in the reduced vector and the round is reduced once more at the larger
capacity. The number of collectives thus depends only on agreed values.

Questions travel as columns (numpy arrays), so a round of a thousand costs
about what a round of one does. Nothing here does I/O or touches threads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from cpcache.agreement.kinds import VOTE
from cpcache.errors import FAMILY, CacheError, Divergence, InvalidArgument
from cpcache.hashing import HASH_MASK as _HASH_MASK
from cpcache.hashing import hash62
from cpcache.values import INT64_MAX, Reduce

HEADER_SLOTS = 7
NO_REJECTION = INT64_MAX
# Status codes a rejection can carry, by name (slot 6 holds rank * 16 + index):
# the base error's (INTERNAL, also what an unknown status travels as), then
# each status of the error family once, in the family's order.
REJECTION_STATUSES = tuple(dict.fromkeys((CacheError.status, *(kind.status for kind in FAMILY))))
MIN_CAPACITY = 64
# Fingerprints and digests are kept below 2**62 so that negation never overflows.



class Labelled(Protocol):
    """Something a divergence report can name ("write 7")."""

    def label(self) -> str: ...


@dataclass(frozen=True)
class Questions:
    """Questions as equal-length int64 columns."""

    op_ids: np.ndarray
    kinds: np.ndarray
    reduces: np.ndarray
    locals: np.ndarray

    @staticmethod
    def empty() -> Questions:
        z = np.empty(0, dtype=np.int64)
        return Questions(z, z, z, z)

    @staticmethod
    def votes(op_ids: npt.ArrayLike, reduces: npt.ArrayLike, values: npt.ArrayLike) -> Questions:
        """One-shot votes from a scheduler, validated: op ids in [0, 2**63)
        and unique, reductions MIN or MAX, values inside int64 with room for
        negation."""
        try:
            ids = np.asarray(op_ids, dtype=np.uint64)
            vals = np.asarray(values, dtype=np.int64)
        except OverflowError as exc:
            raise InvalidArgument(f"votes: a value does not fit in int64 ({exc})") from None
        reds = np.asarray(reduces, dtype=np.int64)
        if not len(ids) == len(reds) == len(vals):
            raise InvalidArgument(
                f"votes: op_ids, reduces and values must have equal lengths, got {len(ids)}, {len(reds)}, {len(vals)}"
            )
        if len(ids):
            if ids.max() > INT64_MAX:
                raise InvalidArgument(f"votes: op id {int(ids.max())} is outside [0, 2**63)")
            if vals.min() == -INT64_MAX - 1:
                raise InvalidArgument(f"votes: value {-INT64_MAX - 1} is outside the int64 range (-2**63, 2**63)")
            bad = (reds != Reduce.MIN) & (reds != Reduce.MAX)
            if bad.any():
                raise InvalidArgument(f"votes: operation {int(ids[bad][0])} has no valid reduce (MIN or MAX)")
            ordered = np.sort(ids)
            repeated = ordered[1:] == ordered[:-1]
            if repeated.any():
                raise InvalidArgument(f"votes: op id {int(ordered[1:][repeated][0])} appears twice in one step")
        ids = ids.astype(np.int64)
        return Questions(ids, np.full(len(ids), VOTE.code, dtype=np.int64), reds, vals)

    def __len__(self) -> int:
        return len(self.op_ids)

    def concat(self, other: Questions) -> Questions:
        if not len(other):
            return self
        if not len(self):
            return other
        return Questions(*(np.concatenate(pair) for pair in zip(self.columns(), other.columns())))

    def columns(self) -> tuple[np.ndarray, ...]:
        return (self.op_ids, self.kinds, self.reduces, self.locals)

    def sorted(self) -> Questions:
        order = np.lexsort((self.kinds, self.op_ids))
        return Questions(*(c[order] for c in self.columns()))


@dataclass(frozen=True)
class RoundInput:
    """One rank's contribution to round `number`."""

    number: int
    questions: Questions  # sorted by (op id, kind)
    fingerprint: int
    digest: int
    vector: np.ndarray
    rejection: Rejection | None = None  # this rank's own, when it rejected the step
    labels: Mapping[int, Labelled] | None = None  # the asking operations, named only for divergence reports
    content: tuple[str, ...] = ()  # what the step carried, for divergence reports

    @staticmethod
    def pack(number: int, questions: Questions, digest: int, content_digest: int = 0,
             labels: Mapping[int, Labelled] | None = None, content: tuple[str, ...] = ()) -> RoundInput:
        """`content_digest` covers what the step carries beyond its questions
        (the operations it opens), so ranks that were sent different steps
        disagree in this round's header."""
        q = questions.sorted()
        shape = np.concatenate(([number, content_digest], q.op_ids, q.kinds, q.reduces)).astype(np.int64)
        fingerprint = hash62(shape.tobytes())
        digest &= _HASH_MASK
        vector = np.empty(HEADER_SLOTS + len(q), dtype=np.int64)
        vector[:HEADER_SLOTS] = (fingerprint, -fingerprint, digest, -digest, -len(q), 0, NO_REJECTION)
        vector[HEADER_SLOTS:] = np.where(q.reduces == Reduce.MIN, q.locals, -q.locals)
        return RoundInput(number, q, fingerprint, digest, vector, None, labels, content)

    @staticmethod
    def rejected(number: int, rank: int, status: str, message: str) -> RoundInput:
        """This rank's entry into a round whose step it refused."""
        rejection = Rejection(rank, status, message)
        vector = np.array([0, 0, 0, 0, 0, -1, rejection.code()], dtype=np.int64)
        return RoundInput(number, Questions.empty(), 0, 0, vector, rejection)

    def description(self) -> bytes:
        """What this rank asked, for naming differences after a divergence."""
        q = self.questions
        labels = self.labels or {}
        return json.dumps(
            {
                "fingerprint": self.fingerprint,
                "digest": self.digest,
                "questions": np.stack((q.op_ids, q.kinds, q.reduces), axis=1).tolist(),
                "labels": {str(k): v.label() for k, v in labels.items()},
                "content": list(self.content),
            }
        ).encode()

    def reduce(self, reduce_min: Callable[[np.ndarray], None], capacity: int) -> tuple[np.ndarray, int]:
        """Reduce this round at the agreed `capacity` with `reduce_min`
        (in place, over the whole domain), growing it once if some rank
        needs more. Returns the reduced vector and the next round's capacity."""
        framed = self.framed(capacity)
        reduce_min(framed)
        agreed_count = int(-framed[4])
        if agreed_count > capacity:
            framed = self.framed(next_capacity(agreed_count))
            reduce_min(framed)
        return framed, next_capacity(agreed_count)

    def framed(self, capacity: int) -> np.ndarray:
        """This rank's vector at `capacity` answers: what the collective reduces."""
        framed = np.full(HEADER_SLOTS + capacity, INT64_MAX, dtype=np.int64)
        kept = min(len(self.vector), HEADER_SLOTS + capacity)
        framed[:kept] = self.vector[:kept]
        return framed

    def holds(self, reduced: np.ndarray) -> bool:
        """Whether `reduced` can be a MIN over the domain that took this
        rank's vector: every slot at or below this rank's (a peer's result
        for this round, told through the store, is checked so before it is
        applied here)."""
        capacity = len(reduced) - HEADER_SLOTS
        if reduced.dtype != np.int64 or capacity < len(self.vector) - HEADER_SLOTS:
            return False
        return bool(np.all(reduced <= self.framed(capacity)))

    def decode(self, reduced: np.ndarray) -> RoundResult:
        """Read the reduced vector: a rejected round (naming the lowest
        rejecting rank and its status), or the agreed answers. Raises
        `Divergence` (without rank names: see `explain_divergence`) when
        ranks sent different headers."""
        if reduced[5] < 0:
            rank, status = Rejection.decode(int(reduced[6]))
            empty = np.empty(0, dtype=np.int64)
            return RoundResult(self.number, self.digest, empty, empty, empty, Rejection(rank, status, ""))
        same_questions = reduced[0] == -reduced[1]
        same_state = reduced[2] == -reduced[3]
        if not (same_questions and same_state):
            raise Divergence(f"round {self.number}: ranks disagree")
        q = self.questions
        packed = reduced[HEADER_SLOTS : HEADER_SLOTS + len(q)]
        values = np.where(q.reduces == Reduce.MIN, packed, -packed)
        return RoundResult(self.number, self.digest, q.op_ids, q.kinds, values)


@dataclass(frozen=True)
class Rejection:
    """A rank refused the step of a round: which rank, the status it was told
    (by name), and why (its own message; filled in from that rank's report)."""

    rank: int
    status: str
    message: str

    def code(self) -> int:
        index = REJECTION_STATUSES.index(self.status) if self.status in REJECTION_STATUSES else 0
        return self.rank * 16 + index

    @staticmethod
    def decode(code: int) -> tuple[int, str]:
        return code // 16, REJECTION_STATUSES[code % 16] if code % 16 < len(REJECTION_STATUSES) else "INTERNAL"


def next_capacity(count: int) -> int:
    """The capacity that fits `count` answers: a power of two, at least
    MIN_CAPACITY. A pure function of an agreed count, so equal everywhere."""
    return max(MIN_CAPACITY, 1 << max(0, count - 1).bit_length())


@dataclass(frozen=True)
class RoundResult:
    """What every rank of the domain agreed in one round, as columns."""

    number: int
    digest: int
    op_ids: np.ndarray
    kinds: np.ndarray
    values: np.ndarray
    rejection: Rejection | None = None  # set when some rank rejected the step: nothing else counts

    def of_kind(self, kind: int) -> tuple[np.ndarray, np.ndarray]:
        """(op ids, agreed values) of the questions of one kind, by op id."""
        mask = self.kinds == kind
        return self.op_ids[mask], self.values[mask]
