"""The exhaustive check of leaving an epoch under a round in its collective
and jobs in flight (docs/design.md rule 10), and the defects it finds when
reintroduced (a round applied after the leave, jobs reading the pool when
they run, and a round its peer applied discarded by the leaving rank)."""

import time

import pytest

from .fencing_model import check_fencing

pytestmark = pytest.mark.timeout(120)


def test_leaving_an_epoch_fences_rounds_and_jobs_in_every_order(capsys):
    started = time.perf_counter()
    found = check_fencing()
    with capsys.disabled():
        print(f"\nfencing model: {found.states} states, {found.transitions} transitions, {found.terminals} ends; "
              f"{time.perf_counter() - started:.2f}s")


def found(*mutations):
    violations = set()
    check_fencing(frozenset(mutations), collect=violations)
    return violations


def test_it_finds_a_round_applied_after_its_rank_left():
    violations = found("apply_after_leave")
    assert "a round was applied after its rank left" in violations, violations
    # The session fence alone stops its copy; without it too (both
    # mutations together) the copy overwrites the next session's slot.
    both = found("apply_after_leave", "pool_at_run_time")
    assert "an old epoch's copy overwrote a slot the next session holds" in both, both


def test_it_finds_a_round_its_peer_applied_discarded_when_the_stepper_leaves_first():
    violations = found("leave_first")
    assert "the peer applied a round this rank did not" in violations, violations


def test_it_finds_a_load_landing_in_the_next_sessions_pool():
    violations = found("pool_at_run_time")
    assert "an old session's load landed in the next session's pool" in violations, violations


def test_it_finds_the_close_sentinel_eaten_by_a_failed_round():
    violations = found("sentinel_eaten")
    assert any("not really left" in v and "groups open" in v for v in violations), violations
