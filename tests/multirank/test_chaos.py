"""A short `cpcache bench chaos`: four real daemons (TP 4 x CP 2, one domain),
one simulated scheduler per rank on the blocking `Client` with its peers, and
faults at random moments, combined ones among them (docs/design.md rule 12).
Every step must end alike on every rank that sent it, and nothing may hang."""

import pytest

from cpcache.testing.chaos import ChaosConfig, run_chaos

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(420)]

# A fixed deck: a combined fault first (two daemons at once), an exact-moment
# one (a restarted daemon dying between a round and its reply), a kill while
# a scheduler or daemon is stopped, and single faults.
KINDS = ("two_daemons", "kill_then_round_exit", "daemon_sigkill", "scheduler_pause", "kill_while_stopped", "flood")


def test_a_short_chaos_run_ends_every_step_alike_on_every_rank(run_dir):
    cfg = ChaosConfig(tp=4, cp=2, minutes=1.0, seed=5, kinds=KINDS, fault_every_s=7.0, settle_s=150.0,
                      run_dir=run_dir)
    report = run_chaos(cfg)
    summary = "\n".join([f"seed {cfg.seed}, logs in {report['run_dir']}"]
                        + [f"{d['cause']}: {d['scenario']}" for d in report["divergent_steps"]]
                        + [f"hang: {h}" for h in report["hang_list"]])
    assert report["hangs"] == 0, summary
    assert report["divergences"] == 0, summary
    assert report["wrong_decisions"] == 0, report["wrong_decision_list"]
    assert not report["harness_errors"], report["harness_errors"]
    # The faults were injected, a combined one among them, and ranks fell back and came back.
    assert report["faults_combined"] >= 1 and report["faults"] >= 3, report["faults_by_kind"]
    assert report["steps_replied_alike"] > 100
    assert report["fallbacks_match"] and report["reattaches_match"], (report["fallbacks"], report["reattaches"])
    assert sum(len(v) for v in report["reattaches"].values()) > 0
