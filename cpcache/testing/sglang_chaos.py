"""`cpcache bench sglang-chaos`: a real `sglang.launch_server` over `cpcache
launch` daemons under cache-heavy traffic, and every few seconds a fault on
a random rank at a random moment (docs/design.md rule 12: a daemon's fate is
never the server's).

The server runs at `--shape tp2` (`--tp 2`) or `cp2` (`--tp 2 --attn-cp-size
2`) with the backend's default settings (the overlapped load-back) but for
its call deadline `timeout_s` (`--backend-timeout-s`), which must exceed the
daemons' agreement timeout (`--agreement-timeout-s`, set in their settings
file) by more than 5 s. Traffic and the reply checks are the soak's
(sglang_soak.py): multi-turn requests over documents that overflow the device
and host pools, every reply compared with a server without cache. Copies are
slowed (every copy waits uniform(0, --copy-delay-ms) ms, rank 1 twice as
long; each layer of a load-back --layer-delay-ms), and storage calls too, so
loads, writes and prefetches are open when a fault lands.

The faults, single and combined, are dealt as sglang_chaos_faults.py says.

The server's log says when each rank fell back to the device tree and
attached again, at which scheduler iteration (lines timed by SGLang's own
millisecond stamps, `SGLANG_LOG_MS`). Those lines are grouped into episodes
(from one rank's fallback while every rank was attached until every rank is
attached again), each laid at the last fault before it began. The property:
after each fault every rank falls back at the same iteration (or none does)
and attaches again at the same iteration.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import threading
import time
import urllib.error
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from cpcache.client import Client
from cpcache.client.connection import check_deadline
from cpcache.errors import InvalidArgument
from cpcache.testing.chaos_episodes import (
    LineTimes,
    analyse,
    daemon_restarts,
    events_of,
    still_fallen,
)
from cpcache.testing.daemon_probe import what_is_open
from cpcache.testing.sglang_chaos_faults import KINDS, Injector, daemon_pid, scheduler_pids
from cpcache.testing.sglang_cpu.servers import Watched, make_tiny_model
from cpcache.testing.sglang_cpu.stacks import DOCS, SLOW_RANK, Shape, Stack, started, workload
from cpcache.testing.sglang_soak import HttpTraffic, client_loop, run_reported

# -- the run --------------------------------------------------------------------------------


@contextlib.contextmanager
def chaos_stack(work: Path, args: argparse.Namespace) -> Iterator[Stack]:
    """The soak's stack at `args.shape`, with the chaos run's deadlines and
    slowed load-backs; every SGLang process stamps its log lines to the
    millisecond (SGLANG_LOG_MS, read when the servers start)."""
    shape = Shape(args.family, tp=2, cp=2 if args.shape == "cp2" else 1, zigzag=args.zigzag, storage=args.storage)
    model = make_tiny_model(work / shape.family, shape.family)
    slow = {SLOW_RANK: dict(fault_copy_delay_ms=args.copy_delay_ms * 2,
                            fault_storage_delay_ms=args.storage_delay_ms * 2,
                            fault_storage_fail_rate=args.storage_fail_rate, fault_seed=args.seed)}
    before = os.environ.get("SGLANG_LOG_MS")
    os.environ["SGLANG_LOG_MS"] = "1"
    try:
        with started(work, model, shape, copy_delay_ms=args.copy_delay_ms, storage_delay_ms=args.storage_delay_ms,
                     per_rank=slow, backend={"timeout_s": args.backend_timeout_s},
                     daemon_settings=dict(agreement_timeout_s=args.agreement_timeout_s,
                                          fault_copy_layer_delay_ms=args.layer_delay_ms)) as stack:
            yield stack
    finally:
        if before is None:
            os.environ.pop("SGLANG_LOG_MS", None)
        else:
            os.environ["SGLANG_LOG_MS"] = before


def _processes(stack: Stack) -> tuple[Watched, Watched]:
    assert stack.cpcache.process is not None and stack.daemons.process is not None
    return stack.cpcache.process, stack.daemons.process


def run(args: argparse.Namespace, work: Path) -> dict:
    began = time.monotonic()
    with chaos_stack(work, args) as stack:
        ready_s = time.monotonic() - began
        server, launcher = _processes(stack)
        schedulers = scheduler_pids(server.proc.pid)
        daemons = {r: daemon_pid(launcher.proc.pid, r) for r in range(stack.ranks)}
        if len(schedulers) != stack.ranks or None in daemons.values():
            raise RuntimeError(f"sglang-chaos: found schedulers {schedulers} and daemons {daemons} for "
                               f"{stack.ranks} ranks")
        with Client(stack.daemons.socket(0), timeout_s=10) as daemon:
            agreement_s = daemon.status().agreement_timeout_s
        times = LineTimes(server)
        system, docs = workload(seed=args.seed, docs=DOCS)
        traffic = HttpTraffic()
        t0, deadline = time.time(), time.monotonic() + args.minutes * 60
        clients = [threading.Thread(target=client_loop, daemon=True,
                                    args=(stack, traffic, args.seed * 100 + c, deadline, args.hang_s, system, docs))
                   for c in range(args.clients)]
        injector = Injector(stack, seed=args.seed, kinds=args.fault_kinds, every_s=args.fault_every_s,
                            agreement_s=agreement_s, timeout_s=args.backend_timeout_s, until=deadline)
        for c in clients:
            c.start()
        injector.start()
        for c in clients:
            c.join()
        injector.halt.set()
        injector.join()
        served_s = time.monotonic() - began - ready_s
        alive = server.proc.poll() is None
        settled, flushed = _settle(stack, args.settle_s) if alive else (False, False)
        if alive and not flushed:
            traffic.hangs += 1  # the server did not flush at the end
        logs = stack.decision_logs()
        sessions = _session_logs(server)
        epochs = [what_is_open(stack.daemons.socket(r), timeout_s=10).get("epoch") for r in range(stack.ranks)]
        events = events_of(times.timed())
        exit_code = server.proc.poll()
        report = {
            "shape": stack.shape.name, "minutes": args.minutes, "clients": args.clients, "ready_s": round(ready_s, 1),
            "served_s": round(served_s, 1), "agreement_timeout_s": agreement_s,
            "backend_timeout_s": args.backend_timeout_s, "fault_every_s": args.fault_every_s,
            "server_exits": 0 if exit_code is None else 1, "server_exit_code": exit_code,
            "schedulers_alive": len(scheduler_pids(server.proc.pid)) if exit_code is None else 0,
            "settled": settled, **traffic.as_dict(),
            **analyse(injector.faults, events, stack.ranks, t0),
            **daemon_restarts(launcher, stack.ranks),
            "decision_logs_agree": len(logs) == stack.ranks and len(set(logs.values())) == 1,
            "session_logs_agree": len(sessions) == stack.ranks and len(set(sessions.values())) == 1,
            "daemon_epochs": epochs,  # each re-formation of the domain is a new epoch (None: no answer)
            "perturbation": {"copy_delay_ms": args.copy_delay_ms, "layer_delay_ms": args.layer_delay_ms,
                             "storage_delay_ms": args.storage_delay_ms, "slow_rank": SLOW_RANK,
                             "slow_rank_storage_fail_rate": args.storage_fail_rate},
        }
        if exit_code is not None:
            gone = times.exited_at or time.time()
            report["server_exit_evidence"] = {
                "exited_s": round(gone - t0, 2),
                "faults_before": [asdict(f) for f in injector.faults if gone - 60 <= f.at <= gone][-4:],
                "cpcache_lines": [line.strip() for _, line in times.timed()[-20:]],
                "log_tail": [line.rstrip() for line in server.lines[-60:]],
                "launcher_tail": [line.rstrip() for line in launcher.lines[-20:]]}
        times.stop()
    report["ok"] = (report["server_exits"] == 0 and report["wrong"] == 0 and report["hangs"] == 0
                    and report["errors"] == 0 and report["requests"] > 0 and report["faults"] > 0
                    and report["faults_fallback_differs"] == 0 and report["faults_reattach_differs"] == 0
                    and report["episodes_unfinished"] == 0)
    return report


def _settle(stack: Stack, timeout_s: float) -> tuple[bool, bool]:
    """After the faults: until every rank is attached again (on the log's
    lines), then flush_cache, which logs each rank's decision log. ->
    (settled, flushed)."""
    server, _ = _processes(stack)
    with server.new_line:
        settled = server.new_line.wait_for(lambda: not still_fallen(server.lines) or server.exited.is_set(),
                                           timeout_s) and server.proc.poll() is None
    try:
        before = len(server.lines_with("decision log:"))
        stack.cpcache.flush_cache(attempts=1000)
        server.wait_lines("decision log:", before + stack.ranks, timeout_s=120)
    except (RuntimeError, OSError, urllib.error.URLError) as exc:
        print(f"sglang-chaos: the server did not flush at the end: {exc}", file=sys.stderr)
        return bool(settled), False
    return bool(settled), True


def _session_logs(server: Watched) -> dict[int, str]:
    """Every rank's decision log since its last attach, as of the last flush."""
    logs: dict[int, str] = {}
    for line in server.lines_with("decision log:"):
        found = re.search(r"rank (\d+) decision log: .*since the last attach (\d+ steps, digest \w+)", line)
        if found:
            logs[int(found[1])] = found[2]
    return logs


def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"fault kinds are {', '.join(KINDS)}; got {text!r}")
    return kinds


def add_flags(bench: argparse.ArgumentParser) -> None:
    """sglang-chaos's own flags, on its `cpcache bench sglang-chaos` parser;
    it takes the soak's too (sglang_soak.add_flags: --minutes, --clients,
    --hang-s, --family, --copy-delay-ms, --storage-delay-ms,
    --storage-fail-rate), and --seed, --layer-delay-ms and --work-dir."""
    chaos = bench.add_argument_group("the faults dealt")
    chaos.add_argument("--shape", choices=["tp2", "cp2"], default="cp2",
                       help="the server's shape: --tp 2, or --tp 2 --attn-cp-size 2")
    chaos.add_argument("--fault-every-s", type=float, default=6.5,
                       help="a fault every uniform(0.75, 1.25) x this many seconds after the last ended")
    chaos.add_argument("--fault-kinds", type=_kinds, default=list(KINDS), metavar="KIND,...",
                       help=f"the faults dealt (default: all of {', '.join(KINDS)})")
    chaos.add_argument("--agreement-timeout-s", type=float, default=5.0,
                       help="the daemons' agreement_timeout_s")
    chaos.add_argument("--backend-timeout-s", type=float, default=12.0,
                       help="the SGLang backend's timeout_s (above the agreement timeout + 5 s)")
    chaos.add_argument("--settle-s", type=float, default=180.0,
                       help="after the faults, longest wait for every rank to attach again")


def main(args: argparse.Namespace) -> int:
    try:  # the backend's own rule, refused before anything starts
        check_deadline(args.backend_timeout_s, args.agreement_timeout_s)
    except InvalidArgument as exc:
        print(f"sglang-chaos: --backend-timeout-s: {exc}", file=sys.stderr)
        return 2
    return run_reported("sglang-chaos", args, run, text_report)


def text_report(report: dict) -> str:
    lines = ["  #     t_s  kind               rank  pause_s  open                   fallback its      "
             "re-attach its     without tiers s  slots"]
    for row in report["fault_list"]:
        lines.append(f"{row['n']:3d} {row['t_s']:7.1f}  {row['kind']:<18} {row['rank']:4d} {row['pause_s']:8.2f}  "
                     f"{','.join(row['open']):<22} {_its(row['fallback_iterations']):<17} "
                     f"{_its(row['reattach_iterations']):<17} {_spans(row['without_tiers_s']):<16} "
                     f"{row['slots_given_back']:5d}" + ("  DIFFERS" if row["fallback_differs"] or
                                                         row["reattach_differs"] else "")
                     + ("  (during a fallback)" if row["during_fallback"] else "")
                     + (f"  (missed: {row['missed']})" if row["missed"] else ""))
    lines += [f"{key}: {value}" for key, value in report.items() if key != "fault_list"]
    return "\n".join(lines)


def _its(episodes: list[dict[str, int]]) -> str:
    return " ".join("/".join(f"{r}:{i}" for r, i in e.items()) for e in episodes) or "-"


def _spans(spans: list[float | None]) -> str:
    return " ".join("open" if s is None else f"{s:.1f}" for s in spans) or "-"
