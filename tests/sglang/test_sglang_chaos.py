"""`cpcache bench sglang-chaos` for a few minutes, through the CLI as a user
runs it: a CP server (tp 2, attention CP 2) over `cpcache launch` daemons
under cache-heavy traffic with slowed copies, and every few seconds a fault
on a random rank (daemon SIGKILL, SIGTERM, SIGSTOP; scheduler SIGSTOP past
the client deadline), alone or two at once (a kill while the peer's daemon or
scheduler is stopped, two daemons at once, a graceful stop while the domain
forms again after a kill). The server stays up, every reply is right, nothing
hangs, and after each fault every rank leaves the tiers at one iteration
and comes back at one iteration (docs/design.md rule 12).

The episode bookkeeping the report rests on is checked on its own first,
on log lines written here (no SGLang needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cpcache.testing.chaos_episodes import Fault, analyse, episodes_of, events_of, still_fallen
from cpcache.testing.sglang_chaos_faults import KINDS
from cpcache.testing.sglang_cpu.servers import SGLANG_PYTHON

CPCACHE = Path(sys.executable).parent / "cpcache"


def line(stamp: str, text: str) -> tuple[float, str]:
    return (0.0, f"[2026-12-04 10:00:{stamp} TP0] {text}\n")


def fell(rank: int, iteration: int) -> str:
    return (f"cpcache: rank {rank} fell back to the device tree at iteration {iteration}: the daemon cannot answer "
            f"(x); attaching again from iteration {iteration + 32}")


def back(rank: int, iteration: int) -> str:
    return f"cpcache: rank {rank} attached again at iteration {iteration}; host and storage tiers in use again"


def test_a_fault_whose_ranks_leave_and_come_back_together_agrees():
    events = events_of([line("01.000", fell(0, 100)), line("01.010", fell(1, 100)),
                        line("03.000", "cpcache: rank 1 gave back 16 device slots of loads its last session left "
                                       "undecided"),
                        line("03.500", back(0, 128)), line("03.510", back(1, 128))])
    [episode] = episodes_of(events)
    assert episode.fallbacks == {0: 100, 1: 100} and episode.reattaches == {0: 128, 1: 128}
    assert not episode.fallback_differs(2) and not episode.reattach_differs()
    assert episode.without_tiers_s() == pytest.approx(2.51) and episode.slots_given_back == 16
    at = events[0].at
    report = analyse([Fault(1, "daemon_sigkill", 0, at - 0.5, {"attached": True, "open_loads": 1}),
                      Fault(2, "daemon_sigterm", 1, at + 10, {"error": "gone"}),
                      Fault(3, "daemon_sigstop", 0, at + 20, {"attached": True, "open_prefetches": 2,
                                                               "open_writes": 1})], events, 2, at - 1)
    assert report["faults"] == 3 and report["faults_with_fallback"] == 1
    assert report["faults_fallback_differs"] == report["faults_reattach_differs"] == 0
    assert report["faults_by_open"] == {"load": 1, "unreachable": 1, "write": 1, "prefetch": 1}
    assert report["fault_list"][0]["fallback_iterations"] == [{"0": 100, "1": 100}]


def test_ranks_that_leave_apart_or_come_back_apart_are_counted():
    apart = events_of([line("01.000", fell(0, 100)), line("01.100", fell(1, 101)),
                       line("02.000", back(0, 128)), line("02.100", back(1, 128))])
    one_only = events_of([line("05.000", fell(0, 200)), line("06.000", back(0, 224))])
    late = events_of([line("08.000", fell(0, 300)), line("08.000", fell(1, 300)),
                      line("09.000", back(0, 320)), line("09.500", back(1, 352))])
    events = apart + one_only + late
    episodes = episodes_of(events)
    assert [(e.fallback_differs(2), e.reattach_differs()) for e in episodes] == \
        [(True, False), (True, False), (False, True)]
    faults = [Fault(n, kind, 0, e.start - 0.1, {"attached": True}) for n, (kind, e) in
              enumerate(zip(KINDS, episodes), 1)]
    report = analyse(faults, events, 2, 0.0)
    assert report["faults_fallback_differs"] == 2 and report["faults_reattach_differs"] == 1
    assert len(report["disagreements"]) == 3


def test_a_rank_still_fallen_back_at_the_end_leaves_its_episode_unfinished():
    texts = [fell(0, 10), fell(1, 10), back(0, 32)]
    episodes = episodes_of(events_of([line(f"0{i}.000", t) for i, t in enumerate(texts)]))
    assert [e.end for e in episodes] == [None] and episodes[0].reattach_differs()
    assert still_fallen([f"[x TP1] {t}" for t in texts]) == {1}


def exit_evidence(report: dict) -> str:
    """The server's exit as lines a reader can follow (a dict's repr is cut short)."""
    evidence = report.get("server_exit_evidence") or {}
    # The log's end first (a traceback is there): a failure's report may be shown cut after its first lines.
    parts = [f"the server exited with code {report.get('server_exit_code')} at {evidence.get('exited_s')} s",
             "-- its log's last lines:", *evidence.get("log_tail", ())[-30:],
             f"-- the faults of the minute before: {evidence.get('faults_before')}",
             "-- its last cpcache lines:", *evidence.get("cpcache_lines", ()),
             "-- the daemons' launcher:", *evidence.get("launcher_tail", ())]
    return "\n".join(str(part) for part in parts)


@pytest.mark.sglang
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason=f"SGLang's environment is not built ({SGLANG_PYTHON}); "
                    "`make setup` builds it")
def test_a_few_minutes_of_faults_on_a_cp_server_never_stop_it_nor_split_its_ranks(tmp_path: Path):
    # Two minutes, a fault about 4 s after the last one ended (a dozen here:
    # every kind dealt, the deck's first round within about 100 s);
    # docs/benchmarks.md's runs are 10 and 30 minutes.
    run = subprocess.run([str(CPCACHE), "bench", "sglang-chaos", "--shape", "cp2", "--minutes", "2",
                          "--fault-every-s", "4", "--json",
                          "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=1100)
    assert run.stdout.strip(), f"no report (exit {run.returncode}):\n{run.stderr[-3000:]}"
    report = json.loads(run.stdout.strip().splitlines()[-1])
    print("sglang-chaos:", json.dumps(report))
    assert report["server_exits"] == 0, exit_evidence(report)
    assert report["requests"] > 0 and report["wrong"] == 0, report["first_wrong"]
    assert report["hangs"] == 0 and report["errors"] == 0
    assert report["faults_fallback_differs"] == 0 and report["faults_reattach_differs"] == 0, \
        report["disagreements"]
    assert report["episodes_unfinished"] == 0
    # The deck deals every kind once before any twice: two minutes deal each, single and combined.
    assert all(report["faults_by_kind"].get(kind, 0) >= 1 for kind in KINDS), report["faults_by_kind"]
    assert run.returncode == 0, run.stderr[-3000:]
