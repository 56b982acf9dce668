"""The chaos bench's reading of what the ranks recorded (cpcache/testing/chaos_report.py),
on made-up logs: a step one rank applied and another failed is a divergence,
ranks failing alike is not, an attach try that attached some ranks only is
one too; and detached ranks try again at the same absolute iterations."""

import argparse
from types import SimpleNamespace

from cpcache.testing.chaos import add_flags, config_of
from cpcache.testing.chaos_rank import AttachTries, Entry
from cpcache.testing.chaos_report import compare, differences


def ranks(*logs):
    return [SimpleNamespace(rank=r, log=log) for r, log in enumerate(logs)]


def test_a_step_applied_on_one_rank_and_failed_on_another_is_a_divergence_named_with_its_ranks():
    ok = Entry(10.0, 3, 7, "reply aa")
    lost = Entry(10.0, 3, 7, "error PeerLost", "UNAVAILABLE: round 7 failed: ranks [2] stopped sending heartbeats")
    alike = Entry(11.0, 3, 8, "error PeerLost", "UNAVAILABLE: round 8 failed")
    report = compare(ranks({1: ok, 2: alike}, {1: ok, 2: alike}, {1: lost, 2: alike}), [], 0.0, 8.0)
    assert report["divergences"] == 1 and report["steps_failed_alike"] == 1
    (split,) = report["divergent_steps"]
    assert (split["iteration"], split["applied"], split["failed"], split["cause"]) == (1, [0, 1], [2], "round_split")
    assert "r2 error PeerLost (epoch 3 step 7)" in split["scenario"]


def test_a_rank_whose_recovery_found_no_peer_is_named_so():
    ok = Entry(1.0, 1, 5, "reply aa")
    alone = Entry(1.0, 1, 5, "error Unavailable", "...; no daemon of the domain could tell how step 5 ended")
    (split,) = compare(ranks({4: ok}, {4: alone}), [], 0.0, 8.0)["divergent_steps"]
    assert split["cause"] == "recovery_no_peer"


def test_different_replies_diverge_and_an_attach_try_that_attached_some_ranks_only_too():
    report = compare(ranks({1: Entry(0.0, 1, 1, "reply aa")}, {1: Entry(0.0, 1, 1, "reply bb")}), [], 0.0, 8.0)
    assert report["divergences"] == 1
    attached = Entry(0.0, 2, 1, "reply cc", attach="attached")
    refused = Entry(0.0, attach="failed Unavailable")
    report = compare(ranks({9: attached}, {9: refused}), [], 0.0, 8.0)
    assert [d["kind"] for d in report["divergent_steps"]] == ["attach"]
    skipped = Entry(0.0, attach="skipped")
    report = compare(ranks({9: refused}, {9: skipped}), [], 0.0, 8.0)
    assert report["divergences"] == 0 and report["attach_tries_apart"] == 1


def test_ranks_that_fell_back_apart_try_to_attach_at_the_same_iterations():
    early, late = AttachTries(16), AttachTries(16)
    early.fell_back(100)
    late.fell_back(110)
    assert early.next == late.next == 112
    early.failed(112)
    late.skipped(112)  # its wait stays: it still tries where the other does
    assert early.next == 128 and late.next == 128
    assert differences({"0": [5, 9], "1": [5, 10]}) == [{"iteration": 9, "ranks": [0]},
                                                         {"iteration": 10, "ranks": [1]}]


def test_the_command_line_shares_the_bench_flags_it_finds():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--minutes", type=float, default=30.0)
    add_flags(parser)
    cfg = config_of(parser.parse_args(["--tp", "8", "--cp", "8", "--chaos-kinds", "flood,two_daemons"]))
    assert (cfg.tp, cfg.cp, cfg.minutes, cfg.kinds) == (8, 8, 30.0, ("flood", "two_daemons"))
    assert cfg.topology.world_size == 8 and len(cfg.topology.domains()) == 1
