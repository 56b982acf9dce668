"""Round packing, settling and divergence naming, as plain data."""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from cpcache.agreement.divergence import explain_divergence
from cpcache.agreement.kinds import VOTE
from cpcache.agreement.rounds import HEADER_SLOTS, MIN_CAPACITY, REJECTION_STATUSES, Questions, Rejection, RoundInput
from cpcache.errors import FAMILY, Divergence, InvalidArgument
from cpcache.values import Reduce


class table_with:
    """A round's questions, as a scheduler's votes."""

    def __init__(self, *questions):
        self.votes = Questions.votes(*zip(*questions)) if questions else Questions.empty()

    def pack(self, number, digest):
        return RoundInput.pack(number, self.votes, digest)


class InProcessMin:
    """A MIN all-reduce between threads of this process: stands in for gloo
    so that `RoundInput.reduce` runs exactly as the engine runs it."""

    def __init__(self, ranks):
        self._barrier = threading.Barrier(ranks)
        self._slots = [None] * ranks

    def for_rank(self, rank):
        def reduce(vector):
            self._slots[rank] = vector.copy()
            self._barrier.wait(timeout=10)
            np.minimum.reduce(self._slots, out=vector)
            self._barrier.wait(timeout=10)
        return reduce


def reduce_min(*inputs, capacity=MIN_CAPACITY):
    """Reduce one round of every rank; returns rank 0's reduced vector and
    the next capacity each rank computed."""
    collective = InProcessMin(len(inputs))
    with ThreadPoolExecutor(len(inputs)) as pool:
        outs = list(pool.map(lambda r: inputs[r].reduce(collective.for_rank(r), capacity), range(len(inputs))))
    assert len({c for _, c in outs}) == 1
    return outs[0][0]


def test_capacity_grows_in_the_same_round_when_any_rank_needs_more():
    small = table_with((1, Reduce.MIN, 5)).pack(1, 0)
    big = table_with(*[(i, Reduce.MIN, i) for i in range(100)]).pack(1, 0)
    collective = InProcessMin(2)
    with ThreadPoolExecutor(2) as pool:
        (_, cap_a), (reduced, cap_b) = pool.map(
            lambda r: [small, big][r].reduce(collective.for_rank(r), MIN_CAPACITY), range(2)
        )
    assert cap_a == cap_b == 128 and len(reduced) == HEADER_SLOTS + 128
    with pytest.raises(Divergence):
        big.decode(reduced)


def test_min_and_max_answers_from_one_min_reduction():
    a = table_with((1, Reduce.MIN, 5), (2, Reduce.MAX, 0)).pack(7, digest=42)
    b = table_with((1, Reduce.MIN, 3), (2, Reduce.MAX, 1)).pack(7, digest=42)
    result = a.decode(reduce_min(a, b))
    op_ids, values = result.of_kind(VOTE.code)
    assert dict(zip(op_ids.tolist(), values.tolist())) == {1: 3, 2: 1}
    assert result.number == 7


def test_packing_order_does_not_depend_on_opening_order():
    a = table_with((2, Reduce.MIN, 1), (1, Reduce.MIN, 1)).pack(3, 0)
    b = table_with((1, Reduce.MIN, 1), (2, Reduce.MIN, 1)).pack(3, 0)
    assert a.fingerprint == b.fingerprint and (a.vector == b.vector).all()


@pytest.mark.parametrize(
    "other",
    [
        lambda: table_with((1, Reduce.MIN, 5), (3, Reduce.MIN, 0)).pack(7, 42),  # different op
        lambda: table_with((1, Reduce.MAX, 5)).pack(7, 42),  # different reduction
        lambda: table_with((1, Reduce.MIN, 5)).pack(8, 42),  # different step
        lambda: table_with((1, Reduce.MIN, 5)).pack(7, 43),  # different state
    ],
)
def test_any_difference_in_questions_or_state_is_a_divergence(other):
    mine = table_with((1, Reduce.MIN, 5)).pack(7, 42)
    with pytest.raises(Divergence):
        mine.decode(reduce_min(mine, other()))


def test_divergence_names_ranks_and_operations():
    same = table_with((1, Reduce.MIN, 5)).pack(7, 42).description()
    odd = table_with((1, Reduce.MIN, 5), (9, Reduce.MAX, 0)).pack(7, 99).description()
    message = explain_divergence(7, {0: same, 1: same, 2: odd, 3: None})
    assert "operation 9 (vote, MAX) asked by ranks [2] but not by ranks [0, 1]" in message
    assert "ranks [0, 1] have 0x2a" in message and "ranks [2] have 0x63" in message
    assert "ranks [3] did not report" in message


def test_bad_values_and_duplicate_questions_are_refused():
    with pytest.raises(InvalidArgument, match="int64"):
        table_with((1, Reduce.MIN, -(2**63)))
    with pytest.raises(InvalidArgument, match="appears twice"):
        table_with((1, Reduce.MIN, 1), (1, Reduce.MIN, 2))


def test_a_rejection_carries_every_status_of_the_error_family():
    """The statuses a rejection travels with are the family's, each once,
    after INTERNAL (the base error's, and what anything else travels as)."""
    family = {kind.status for kind in FAMILY}
    assert REJECTION_STATUSES[0] == "INTERNAL" and set(REJECTION_STATUSES) == family | {"INTERNAL"}
    assert len(REJECTION_STATUSES) == len(set(REJECTION_STATUSES)) <= 16  # 4 bits of slot 6
    assert "PERMISSION_DENIED" in REJECTION_STATUSES  # told as INTERNAL before the list was derived
    # The numbers travel in rounds between daemons of one domain, old and new
    # alike during an upgrade: a status added later takes the next number.
    assert REJECTION_STATUSES[:7] == ("INTERNAL", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION",
                                      "RESOURCE_EXHAUSTED", "UNAVAILABLE", "PERMISSION_DENIED")
    for rank in (0, 1, 7, 1000):
        for status in REJECTION_STATUSES:
            assert Rejection.decode(Rejection(rank, status, "").code()) == (rank, status)
    assert Rejection.decode(Rejection(3, "CANCELLED", "").code()) == (3, "INTERNAL")  # outside the family
    assert Rejection.decode(3 * 16 + 15) == (3, "INTERNAL")  # an index this rank does not know


def test_a_rejected_round_names_the_lowest_rejecting_rank_and_its_status():
    fine = table_with((1, Reduce.MIN, 5)).pack(7, 42)
    denied = RoundInput.rejected(7, 2, "PERMISSION_DENIED", "attach: no")
    unavailable = RoundInput.rejected(7, 3, "UNAVAILABLE", "draining")
    result = fine.decode(reduce_min(fine, denied, unavailable))
    assert result.rejection is not None
    assert (result.rejection.rank, result.rejection.status) == (2, "PERMISSION_DENIED")
