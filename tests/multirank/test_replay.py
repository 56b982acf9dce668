"""Trace replays on 4 real daemons (attention TP 2 x CP 2): every prefetch
and write policy, file and Mooncake storage, per-rank fault injection. Each
step's replies (decisions and state digest) must be byte-identical on all
ranks, and no load may bring a wrong byte to a device pool. With attention DP
(TP 4 x DP 2: two domains of 2 ranks) each domain gets its own requests and
must agree within itself."""

from pathlib import Path

import pytest

from cpcache.testing.sim.lru_model import model_hit_rates
from cpcache.testing.sim.replay import ReplayConfig, arrivals, replay
from cpcache.testing.sim.trace import PageHasher, load
from cpcache.topology import Topology
from tests.support.budget import more

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240)]

TRACE = Path(__file__).resolve().parents[2] / "traces" / "conversation_trace.jsonl"


def small(run_dir, **kw) -> ReplayConfig:
    defaults = dict(trace=TRACE, requests=40, passes=2, device_pages=512, host_pages=512, batch=4,
                    run_dir=run_dir)
    return ReplayConfig(**{**defaults, **kw})


def assert_agreed_and_exact(report):
    assert report["divergences"] == 0
    assert report["identical_decision_logs"]
    assert report["corrupt_loads"] == 0


# Each prefetch policy, write policy and store at least once in the suite;
# the rest of the grid with CPCACHE_SGLANG_MORE=1 (tests/support/budget.py).
@pytest.mark.parametrize(
    "storage, prefetch_policy, write_policy",
    [
        ("file", "best_effort", "write_through"),
        ("file", "wait_complete", "write_through_selective"),
        ("mooncake", "timeout", "write_back"),
        more("file", "timeout", "write_back"),
        more("mooncake", "best_effort", "write_back"),
        more("mooncake", "wait_complete", "write_through"),
        more("mooncake", "timeout", "write_through_selective"),
    ],
)
async def test_policies_agree_under_per_rank_faults(run_dir, storage, prefetch_policy, write_policy):
    report = await replay(small(run_dir, storage=storage, prefetch_policy=prefetch_policy,
                                write_policy=write_policy, fault_delay_ms=3, seed=5))
    assert_agreed_and_exact(report)
    assert report["decisions"] > 0
    moved = report["pages_moved_rank0"]
    if write_policy in ("write_through", "write_back"):
        # write_back writes on eviction, and this host pool is too small to keep a pass
        assert moved.get("host->storage", 0) > 0
    if write_policy == "write_through" and prefetch_policy != "best_effort":
        # The second pass comes back from storage. (best_effort ends a prefetch
        # at a poll once its reads had prefetch_best_effort_wait_s, with whatever
        # has arrived by then.)
        assert report["hit_rate"]["storage"] > 0
        assert report["verified_pages"] > 0


async def test_replay_with_faults_that_differ_per_rank_still_agrees(run_dir):
    report = await replay(small(run_dir, requests=60, fault_delay_ms=5, fault_fail_rate=0.05, seed=9, lag=1))
    assert_agreed_and_exact(report)
    assert report["steps"] > 20


async def test_hit_rate_matches_an_offline_lru_model(run_dir):
    # A device pool large enough that a request never waits for device pages:
    # the model has no device-side pinning.
    cfg = small(run_dir, requests=600, passes=1, device_pages=4096, host_pages=4096, prefetch_policy="wait_complete")
    report = await replay(cfg)
    assert_agreed_and_exact(report)
    requests = load(cfg.trace, cfg.requests, cfg.skip)
    model = model_hit_rates(requests, list(arrivals(requests, cfg)), PageHasher("00" * 32, 256),
                            cfg.device_pages, cfg.host_pages)
    assert abs(report["hit_rate"]["total"] - model["total"]) <= 0.02, (report["hit_rate"], model)
    assert abs(report["hit_rate"]["device"] - model["device"]) <= 0.02, (report["hit_rate"], model)


async def test_attention_dp_routes_each_request_to_one_domain_that_agrees_within_itself(run_dir):
    # tp=4 dp=2 cp=1: domains {0, 1} and {2, 3}, attention TP 2 each. Per-rank
    # storage delays make the ranks of a domain see I/O finish at different times.
    cfg = small(run_dir, requests=36, topology=Topology(tp=4, dp=2, cp=1), fault_delay_ms=2, seed=3)
    report = await replay(cfg)
    assert_agreed_and_exact(report)
    domains = report["domains"]
    assert [d["ranks"] for d in domains] == [[0, 1], [2, 3]]
    assert [d["dp"] for d in domains] == [0, 1]
    for d in domains:
        assert d["divergences"] == 0, d
        assert d["identical_decision_logs"], d
        assert d["corrupt_loads"] == 0, d
        assert d["decisions"] > 0, d
        assert d["requests"] == cfg.requests * cfg.passes // 2  # round robin: half each, every pass
        assert 0 < d["hit_rate"]["total"] <= 1
    for key in ("requests", "decisions", "divergences", "corrupt_loads", "prefetches"):
        assert report[key] == sum(d[key] for d in domains), key
    assert report["ranks"] == 4


def restartable(run_dir, name, **kw) -> ReplayConfig:
    (run_dir / name).mkdir()
    return small(run_dir / name, requests=60, device_pages=16, host_pages=1024, agreement_timeout_s=2.0, **kw)


async def test_every_scheduler_restarting_halfway_keeps_the_host_tier(run_dir):
    """All schedulers die halfway and attach again: the second half's host
    hits stay within 2 points of the same replay without the restart."""
    baseline = await replay(restartable(run_dir, "baseline"))
    restarted = await replay(restartable(run_dir, "restarted", restart="schedulers"))
    assert_agreed_and_exact(restarted)
    assert restarted["epoch"] == 1 and restarted["restart"]["resumed_pages"] > 0
    second, before = restarted["halves"]["second"], baseline["halves"]["second"]
    assert before["host"] > 0
    assert abs(second["host"] - before["host"]) <= 0.02, (second, before)


@pytest.mark.parametrize("how, lag", [("daemon-kill", 0), ("daemon-stop", 0), ("daemon-kill", 1)])
async def test_a_daemon_lost_mid_replay_comes_back_and_the_replay_finishes_exact(run_dir, how, lag):
    """At lag 1 a rank's scheduler may lack the last reply (a round some
    peers completed): the killed rank's, and a peer's that was still in that
    round's exchange with it. At most one each (`identical_decision_logs`)."""
    report = await replay(restartable(run_dir, how, restart=how, lag=lag))
    assert_agreed_and_exact(report)
    assert lag or not report["replies_lost_with_a_daemon"]
    assert report["epoch"] == 1
    restart = report["restart"]
    assert restart["outage_steps"] >= 1 and restart["outage_s"] > 0
    assert "rank" in restart and report["halves"]["second"]["total"] > 0
