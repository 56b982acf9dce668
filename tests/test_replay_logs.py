"""How a replay compares its schedulers' decision logs: identical, except
that at lag >= 1 a scheduler whose daemon died may lack the last replies."""

from cpcache.testing.sim.replay import agreeing_logs


def test_identical_logs_agree_with_nothing_lost():
    assert agreeing_logs([[b"a", b"b"], [b"a", b"b"]], lag=0) == (True, 0)


def test_a_log_short_by_at_most_lag_replies_agrees_and_counts_them():
    assert agreeing_logs([[b"a", b"b"], [b"a"]], lag=1) == (True, 1)
    assert agreeing_logs([[b"a", b"b", b"c"], [b"a"]], lag=1) == (False, 2)


def test_at_lag_0_every_reply_must_be_there():
    assert agreeing_logs([[b"a", b"b"], [b"a"]], lag=0) == (False, 1)


def test_a_differing_reply_never_agrees():
    assert agreeing_logs([[b"a", b"b"], [b"a", b"x"]], lag=2)[0] is False
    assert agreeing_logs([[b"a", b"b"], [b"x"]], lag=2)[0] is False
