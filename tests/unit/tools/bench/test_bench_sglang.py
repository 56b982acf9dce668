"""`cpcache bench sglang`, its pure parts: reading SGLang's
streamed chunks into TPOT, the backend's log line (as the SGLang backend
writes it) and the difference of two, the per-block ratios, the report's
shape, and its refusal without SGLang's environment.

A whole run starts three real SGLang servers at tp 2 and takes 6 to 7
minutes on this 2-core machine (4 to 5 of them starting the servers), so it
is not run here; docs/benchmarks.md ("Decode latency, and the load-back") has its figures.
"""

import argparse
import json

import pytest

from cpcache.client.outcomes import Tally
from cpcache.integrations.sglang.timing import SchedulerTime
from cpcache.tools.bench import sglang
from cpcache.tools.bench.sglang import (
    SERVERS,
    PromptWaves,
    Stream,
    backend_delta,
    backend_lines,
    block_ratios,
    measure,
    sse_events,
    summarize,
    table,
)
from cpcache.tools.cli import main as cli_main

pytestmark = pytest.mark.timeout(60)


def chunk(ids: list[int], tokens: int) -> bytes:
    return b"data: " + json.dumps({"output_ids": ids, "meta_info": {"completion_tokens": tokens}}).encode() + b"\n"


def test_server_sent_events_stop_at_done_and_skip_other_lines():
    lines = [chunk([7], 1), b"\n", b": keep-alive\n", chunk([8], 2), b"data: [DONE]\n", chunk([9], 3)]
    assert [e["output_ids"] for e in sse_events(lines)] == [[7], [8]]


def test_tpot_is_the_time_from_the_first_token_to_the_last_over_the_tokens_between():
    s = Stream(sent=10.0)
    for at, ids, n in [(10.5, [1], 1), (10.6, [2], 2), (10.6, [], 2), (10.9, [3, 4], 4)]:  # incremental ids
        s.add(at, json.loads(chunk(ids, n)[len(b"data: "):]))
    assert s.output_ids == [1, 2, 3, 4] and s.tokens == 4
    assert s.ttft() == pytest.approx(0.5)
    assert s.tpot() == pytest.approx(0.4 / 3)
    whole = Stream(sent=0.0)
    for at, ids in [(1.0, [5]), (2.0, [5, 6]), (4.0, [5, 6, 7])]:  # every id so far in each chunk
        whole.add(at, {"output_ids": ids, "meta_info": {"completion_tokens": len(ids)}})
    assert whole.output_ids == [5, 6, 7] and whole.tpot() == pytest.approx(1.5)
    gateway = Stream(sent=0.0)
    for at, ids, n in [(1.0, [5], 1), (2.0, [6], 2), (2.1, [6], 2)]:  # a gateway's last chunk repeats the last id
        gateway.add(at, {"output_ids": ids, "meta_info": {"completion_tokens": n}})
    assert gateway.output_ids == [5, 6] and gateway.tokens == 2
    one = Stream(sent=0.0)
    one.add(1.0, {"output_ids": [5], "meta_info": {"completion_tokens": 1}})
    assert one.tpot() is None
    figures = measure([s, whole, one], seconds=2.0)
    assert figures["tpot_ms"] == pytest.approx(1e3 * (0.4 / 3 + 1.5) / 2)  # median of the two with a TPOT
    assert figures["throughput_tok_s"] == pytest.approx(8 / 2.0)


def test_the_backends_line_is_read_back_and_two_lines_give_a_block():
    before = (SchedulerTime(iterations=100, hook_s=0.01, calls_s=0.002), [Tally(steps=3, step_seconds=0.009)])
    # the steps of a session left behind and of the current one, read from their tallies
    after = (SchedulerTime(iterations=160, hook_s=0.04, calls_s=0.005),
             [Tally(steps=4, step_seconds=0.013), Tally(steps=5, step_seconds=0.02)])
    log = [f"[2026-12-03 06:09:42 TP{r}] {t.line(r, sessions)}\n" for t, sessions in (before, after) for r in (0, 1)]
    log.insert(1, "[TP0] Decode batch, #running-req: 4\n")
    read = backend_lines(log)
    assert sorted(read) == [0, 1]
    assert read[0] == {"iterations": 160, "hook_s": 0.04, "calls_s": 0.005, "steps": 9, "step_s": 0.033,
                       "idle": 0, "idle_s": 0.0}
    d = backend_delta(backend_lines(log[:3])[0], read[0])
    assert d["iterations"] == 60 and d["steps"] == 6
    assert d["total_s"] == pytest.approx(0.033)
    assert d["us_per_iteration"] == pytest.approx(0.033 / 60 * 1e6)


def test_idle_iterations_are_counted_and_timed_apart_from_those_that_step():
    clock = SchedulerTime()
    for seconds, idle in [(4e-6, True), (900e-6, False), (6e-6, True), (5e-6, True), (1100e-6, False)]:
        clock.tick(seconds, idle)
    assert (clock.iterations, clock.idle) == (5, 3)
    (read,) = backend_lines([clock.line(0)]).values()
    assert read["idle"] == 3 and read["idle_s"] == pytest.approx(15e-6, abs=1e-6)
    d = backend_delta({k: 0 for k in read}, read)
    assert d["stepping"] == 2
    assert d["us_per_idle_iteration"] == pytest.approx(5.0, abs=0.4)
    assert d["us_per_stepping_iteration"] == pytest.approx(1000.0, abs=1.0)
    old_line = ("cpcache: rank 1 backend: 10 iterations, mean 1.000 us per iteration on the scheduler thread "
                "(hook 0.000010 s, other calls 0.000000 s), 0 steps, 0.000000 s in steps")
    assert backend_lines([old_line])[1]["idle"] == 0  # a backend that counts none apart


def test_the_hook_times_an_iteration_idle_only_when_its_caller_marks_it_so():
    clock = SchedulerTime()
    with clock.hook() as iteration:
        iteration.idle = True
    with clock.hook():
        pass
    with pytest.raises(RuntimeError), clock.hook() as iteration:
        raise RuntimeError("a hook that failed counts, and not as idle")
    assert (clock.iterations, clock.idle) == (3, 1)
    assert clock.hook_s >= clock.idle_s > 0.0


def fake_blocks() -> list[dict[str, dict]]:
    blocks = []
    for radix, hicache, cpcache in [(80.0, 200.0, 84.0), (90.0, 180.0, 90.0), (100.0, 300.0, 130.0)]:
        block = {name: {"tpot_ms": t, "throughput_tok_s": 1000.0 / t, "ttft_ms": 2 * t, "tokens": 256,
                        "seconds": 256 * t / 1000.0 / 4, "cpu_ms_per_token": t / 10, "daemon_cpu_ms_per_token": 0.0}
                 for name, t in zip(SERVERS, (radix, hicache, cpcache))}
        block["cpcache"]["daemon_cpu_ms_per_token"] = 0.5
        block["cpcache"]["backend"] = {
            r: backend_delta({"iterations": 0, "hook_s": 0.0, "calls_s": 0.0, "steps": 0, "step_s": 0.0, "idle": 0,
                              "idle_s": 0.0},
                             {"iterations": 70, "hook_s": 0.1, "calls_s": 0.01, "steps": 9, "step_s": 0.1,
                              "idle": 60, "idle_s": 0.0003})
            for r in (0, 1)}
        blocks.append(block)
    return blocks


def test_ratios_are_taken_per_block_and_reported_as_the_median_with_spread():
    r = block_ratios(fake_blocks(), "tpot_ms", "cpcache", "radix")
    assert r["blocks"] == [1.05, 1.0, 1.3]
    assert r["median"] == 1.05 and r["spread"]["min"] == 1.0 and r["spread"]["max"] == 1.3


def test_the_report_has_every_server_ratio_target_and_the_backends_time():
    workload = PromptWaves(requests=4, waves=2, new_tokens=32)
    report = summarize(fake_blocks(), 0, workload, 250.0, {"start": [1.0], "end": [2.0]}, 400.0)
    json.dumps(report)  # serializable as --json prints it
    assert set(report["servers"]) == set(SERVERS)
    for figures in report["servers"].values():
        assert {"tpot_ms", "throughput_tok_s", "ttft_ms", "cpu_ms_per_token"} <= set(figures)
        assert {"median", "spread", "blocks"} <= set(figures["tpot_ms"])
    assert report["ratios"]["tpot_cpcache_over_radix"]["median"] == 1.05
    assert report["ratios"]["cpu_per_token_cpcache_over_radix"]["median"] == 1.05
    assert report["servers"]["cpcache"]["daemon_cpu_ms_per_token"]["median"] == 0.5
    assert report["targets"]["tpot_cpcache_over_radix"] == {"median": 1.05, "target": "<= 1.1", "met": True}
    assert report["targets"]["tpot_cpcache_over_hicache"]["met"] is True
    assert set(report["backend"]) == {"rank_0", "rank_1"}
    rank0 = report["backend"]["rank_0"]
    assert rank0["us_per_iteration"]["median"] == pytest.approx(0.11 / 70 * 1e6, abs=0.01)
    assert rank0["us_per_decode_iteration"]["median"] == pytest.approx(0.11 / 62 * 1e6, abs=0.01)
    assert rank0["idle_iterations"]["median"] == 60 and rank0["stepping_iterations"]["median"] == 10
    idle = rank0["us_per_idle_iteration"]
    assert idle["median"] == pytest.approx(5.0) and idle["p90"] == 5.0
    assert rank0["us_per_stepping_iteration"]["median"] == pytest.approx(0.0997 / 10 * 1e6)
    assert any("idle iterations 60 per block, 5.00 us each" in line for line in table(report))
    assert report["workload"]["blocks"] == 3 and "paused" in report["mode"]
    assert any("NOT met" not in line and "tpot_cpcache_over_radix" in line for line in table(report))


def test_the_servers_order_rotates_every_block():
    orders = [sglang.order_of(i) for i in range(4)]
    assert orders[0] == SERVERS and orders[3] == SERVERS
    assert [o[0] for o in orders[:3]] == list(SERVERS) and all(sorted(o) == sorted(SERVERS) for o in orders)


def test_cpu_seconds_sum_a_process_group_and_named_pids(monkeypatch):
    monkeypatch.setattr(sglang.os, "sysconf", lambda name: 100)

    def stat(pid: int, comm: str, pgrp: int, utime: int, stime: int) -> str:
        return f"{pid} ({comm}) S 1 {pgrp} {pgrp} 0 -1 4194560 0 0 0 0 {utime} {stime} 0 0 20 0 1 0 1 0 0"

    stats = [stat(10, "sglang::scheduler_TP0", 7, 150, 50), stat(11, "python x) y", 7, 10, 0),
             stat(12, "cpcache.daemon", 12, 30, 20), stat(13, "other", 9, 999, 999)]
    assert sglang.cpu_seconds(stats, {7}, set()) == pytest.approx(2.1)
    assert sglang.cpu_seconds(stats, set(), {12}) == pytest.approx(0.5)
    assert sglang.cpu_seconds(stats, {7}, {12}) == pytest.approx(2.6)
    assert sglang.cpu_seconds(sglang.proc_stats(), set(), {sglang.os.getpid()}) > 0


def test_prompts_share_a_prefix_within_a_block_and_differ_between_blocks():
    workload = PromptWaves(requests=3, waves=2, new_tokens=8)
    waves = workload.prompts(0)
    assert len(waves) == 2 and all(len(w) == 3 for w in waves)
    flat = [p for w in waves for p in w]
    assert all(p[: sglang.PREFIX] == flat[0][: sglang.PREFIX] for p in flat)
    assert len({tuple(p[sglang.PREFIX:]) for p in flat}) == len(flat)
    assert workload.prompts(0) == waves and workload.prompts(1)[0][0][: sglang.PREFIX] != flat[0][: sglang.PREFIX]


def test_without_sglangs_environment_it_says_so_and_fails(monkeypatch, capsys, tmp_path):
    from cpcache.testing.sglang_cpu import servers

    monkeypatch.setattr(servers, "SGLANG_PYTHON", tmp_path / "no-such-python")
    assert cli_main(["bench", "sglang", "--repeat", "1"]) == 1
    err = capsys.readouterr().err
    assert "SGLang's environment is not built" in err and "make setup" in err


def test_the_cli_takes_the_benchs_flags(monkeypatch):
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(sglang, "main", lambda args: seen.append(args) or 0)
    assert cli_main(["bench", "sglang", "--repeat", "2", "--requests", "3", "--waves", "1", "--new-tokens", "16",
                     "--json"]) == 0
    (args,) = seen
    assert (args.repeat, args.requests, args.waves, args.new_tokens, args.json) == (2, 3, 1, 16, True)


def test_descendants_follow_parents_across_process_groups():
    def stat(pid: int, ppid: int, pgrp: int) -> str:
        return f"{pid} (p {pid}) S {ppid} {pgrp} {pgrp} 0 -1 4194560 0 0 0 0 1 1 0 0 20 0 1 0 1 0 0"

    # 20 launches 21 and 22 in groups of their own; 22 starts 23; 30 is another tree.
    stats = [stat(20, 1, 20), stat(21, 20, 21), stat(22, 20, 22), stat(23, 22, 22), stat(30, 1, 30)]
    assert sglang.descendants(stats, {20}) == {20, 21, 22, 23}
    assert sglang.descendants(stats, {22, 30}) == {22, 23, 30}
    assert sglang.descendants(stats, {99}) == {99}
