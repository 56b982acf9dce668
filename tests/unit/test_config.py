"""Settings that cannot work together are refused, naming them."""

import math

import pytest

from cpcache.config import DaemonConfig
from cpcache.errors import InvalidArgument


@pytest.mark.parametrize("drain", [0.5, 10.9, -1.0, math.nan])
def test_a_drain_that_cannot_outlast_a_step_round_is_refused(drain):
    with pytest.raises(InvalidArgument, match=r"setting drain_timeout_s: .*agreement_timeout_s \(10\) \+ 1 = 11 s"):
        DaemonConfig(rank=0, agreement_timeout_s=10.0, drain_timeout_s=drain)


def test_the_default_drain_and_one_long_enough_are_taken():
    assert DaemonConfig(rank=0, agreement_timeout_s=10.0).drain_s == 11.0
    assert DaemonConfig(rank=0, agreement_timeout_s=10.0, drain_timeout_s=11.0).drain_s == 11.0
    assert DaemonConfig(rank=0, agreement_timeout_s=2.0, drain_timeout_s=30.0).drain_s == 30.0
