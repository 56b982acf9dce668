"""Settings that cannot work together are refused, naming them."""

import math

import pytest

from cpcache.config import DaemonConfig
from cpcache.errors import InvalidArgument


@pytest.mark.parametrize("drain", [0.5, 15.9, -1.0, math.nan])
def test_a_drain_that_cannot_outlast_a_failing_step_round_is_refused(drain):
    with pytest.raises(InvalidArgument, match=r"setting drain_timeout_s: must be 0 \(the least\) or at least 16 s: "
                                              r"agreement_timeout_s \(10\), a failed round's wait .* \(3\) .* \(2\)"):
        DaemonConfig(rank=0, agreement_timeout_s=10.0, drain_timeout_s=drain)


def test_the_default_drain_and_one_long_enough_are_taken():
    assert DaemonConfig(rank=0, agreement_timeout_s=10.0).drain_s == 16.0
    assert DaemonConfig(rank=0, agreement_timeout_s=1.0).drain_s == 5.0  # its witness waits 1 s, not 3
    assert DaemonConfig(rank=0, agreement_timeout_s=10.0, drain_timeout_s=16.0).drain_s == 16.0
    assert DaemonConfig(rank=0, agreement_timeout_s=2.0, drain_timeout_s=30.0).drain_s == 30.0


def test_the_drain_floor_counts_the_witness_as_the_agreement_waits_it():
    from cpcache.agreement import witness
    from cpcache.config import WITNESS_READ_S, round_bound_s
    from cpcache.rank import diagnosis

    assert WITNESS_READ_S == witness.READ_S and diagnosis.WITNESS_WAIT_S == 3.0
    assert round_bound_s(10.0) == 15.0 and round_bound_s(1.0) == 4.0
