"""`cpcache bench sglang-soak`: a context-parallel SGLang server over cpcache
daemons under cache-heavy traffic for a given time (default 30 minutes: the
reference system's CP servers stopped answering after 30-40).

The server is a real `sglang.launch_server` at `--tp 2 --attn-cp-size 2`
(tiny random Qwen3, SGLang's CPU path; see cpcache/tools/sglang_cpu) over
`cpcache launch --tp 2 --cp 2` daemons with file storage (or Mooncake Store).
I/O is perturbed per rank: every copy and storage call is slowed on every
rank independently, one rank twice as much, and a share of that rank's
storage reads fail (agreed misses). Traffic: `--clients` concurrent clients
send multi-turn requests (a shared system prompt, documents that overflow
the device and host pools, asked again in random order), so hits come from
every tier. Every reply is checked against a tp 1 server without cache.

Reported: requests served, replies checked and wrong, hangs (a request with
no answer within `--hang-s`), hits per tier, divergences (every rank's
decision log compared at the end, and steps that failed as divergent),
the daemons' rounds.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
from collections.abc import Callable
from pathlib import Path

from cpcache.client import Client
from cpcache.testing.sglang_cpu.servers import Reply, make_tiny_model, same_outputs
from cpcache.testing.sglang_cpu.stacks import DOCS, SLOW_RANK, Shape, Stack, prompt, started, workload

TURNS = 4  # distinct turns per document: the reference answers each prompt once


class HttpTraffic:
    """What the HTTP clients sent and got back (the server's cache decisions
    are in its ranks' decision logs)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.began = time.monotonic()
        self.requests = self.wrong = self.hangs = self.errors = self.reference_errors = 0
        self.tokens = {"prompt": 0, "device": 0, "host": 0, "storage": 0}
        self.first_wrong: list[str] = []

    def count_wrong(self, what: str, got: Reply, want: Reply) -> None:
        """A reply unlike the reference's, described for the report: when
        (from the traffic's start), whether its tokens or only its logprobs
        differ, by how much, and where its prefix came from. Called under
        `lock`."""
        self.wrong += 1
        if len(self.first_wrong) < 3:
            drift = max((abs(a - b) for a, b in zip(got.logprobs, want.logprobs)), default=0.0)
            tokens = "equal" if got.output_ids == want.output_ids else "differ"
            self.first_wrong.append(
                f"{time.monotonic() - self.began:.1f} s, {what}: tokens {tokens}, "
                f"logprobs off by up to {drift:.1e}, hits device {got.device} host {got.host} storage "
                f"{got.storage}: {got} != {want}")

    def as_dict(self) -> dict:
        with self.lock:
            return {"requests": self.requests, "wrong": self.wrong, "hangs": self.hangs, "errors": self.errors,
                    "reference_errors": self.reference_errors, "hit_tokens": dict(self.tokens),
                    "first_wrong": self.first_wrong[:3]}


def client_loop(stack: Stack, traffic: HttpTraffic, seed: int, deadline: float, hang_s: float,
                system: list[int], docs: list[list[int]]) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        d, turn = rng.randrange(len(docs)), rng.randrange(TURNS)
        ids = prompt(system, docs[d], turn, d)
        try:
            want = stack.reference(ids)
        except (urllib.error.URLError, OSError):  # the reference server's trouble, not cpcache's
            with traffic.lock:
                traffic.reference_errors += 1
            continue
        try:
            got = stack.cpcache.generate(ids, timeout_s=hang_s)
        except TimeoutError:
            with traffic.lock:
                traffic.hangs += 1
            continue
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            if isinstance(getattr(exc, "reason", None), TimeoutError):
                with traffic.lock:
                    traffic.hangs += 1
                continue
            with traffic.lock:
                traffic.errors += 1
            if stack.cpcache.process is not None and stack.cpcache.process.proc.poll() is not None:
                return  # the server is gone: reported as errors, nothing more to send
            continue
        with traffic.lock:
            traffic.requests += 1  # every one checked
            traffic.tokens["prompt"] += len(ids)
            traffic.tokens["device"] += got.device
            traffic.tokens["host"] += got.host
            traffic.tokens["storage"] += got.storage
            if not same_outputs(got, want):
                traffic.count_wrong(f"doc {d} turn {turn}", got, want)


def daemon_counters(stack: Stack) -> list[dict[str, int | str]]:
    counters: list[dict[str, int | str]] = []
    for rank in range(stack.ranks):
        try:
            with Client(stack.daemons.socket(rank), timeout_s=10) as daemon:
                counters.append(dict(daemon.stats()))
        except Exception as exc:  # a daemon restarted by the launcher just now
            counters.append({"error": str(exc)})
    return counters


def run(args: argparse.Namespace, work: Path) -> dict:
    shape = Shape(args.family, tp=2, cp=2, zigzag=args.zigzag, storage=args.storage)
    model = make_tiny_model(work / shape.family, shape.family)
    perturbed = {SLOW_RANK: dict(fault_copy_delay_ms=args.copy_delay_ms * 2,
                                 fault_storage_delay_ms=args.storage_delay_ms * 2,
                                 fault_storage_fail_rate=args.storage_fail_rate, fault_seed=args.seed)}
    began = time.monotonic()
    with started(work, model, shape, copy_delay_ms=args.copy_delay_ms, storage_delay_ms=args.storage_delay_ms,
                 per_rank=perturbed) as stack:
        ready_s = time.monotonic() - began
        system, docs = workload(seed=args.seed, docs=DOCS)
        traffic = HttpTraffic()
        deadline = time.monotonic() + args.minutes * 60
        clients = [threading.Thread(target=client_loop, daemon=True,
                                    args=(stack, traffic, args.seed * 100 + c, deadline, args.hang_s, system, docs))
                   for c in range(args.clients)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        served_s = time.monotonic() - began - ready_s
        try:  # a server that hangs here still gets its report
            stack.cpcache.flush_cache(attempts=1000)
            assert stack.cpcache.process is not None
            stack.cpcache.process.wait_lines("decision log:", stack.ranks, timeout_s=120)
        except (RuntimeError, OSError, urllib.error.URLError) as exc:
            traffic.hangs += 1
            print(f"sglang-soak: the server did not flush at the end: {exc}", file=sys.stderr)
        logs = stack.decision_logs()
        counters = daemon_counters(stack)
        fell_back = stack.cpcache.log_lines("fell back to the device tree")
    report = {
        "shape": shape.name, "minutes": args.minutes, "clients": args.clients, "ready_s": round(ready_s, 1),
        "served_s": round(served_s, 1), **traffic.as_dict(),
        "decision_logs": logs, "decision_logs_agree": len(logs) == shape.tp and len(set(logs.values())) == 1,
        # A step that diverged fails on every rank, and the backend leaves the daemon.
        "diverged_steps": sum("diverge" in line.lower() for line in fell_back),
        "daemon_rounds": [c.get("rounds_completed") for c in counters],  # None: the daemon did not answer
        "daemon_errors": [c["error"] for c in counters if "error" in c],
        "fallbacks": len(fell_back),
        "perturbation": {"copy_delay_ms": args.copy_delay_ms, "storage_delay_ms": args.storage_delay_ms,
                         "slow_rank": SLOW_RANK, "slow_rank_storage_fail_rate": args.storage_fail_rate},
    }
    report["divergences"] = report["diverged_steps"] + (0 if report["decision_logs_agree"] else 1)
    # No daemon is killed here: a fallback (a step that failed) is a failure too,
    # and a server that served without its host and storage tiers did not soak them.
    hits = report["hit_tokens"]
    report["ok"] = (report["wrong"] == 0 and report["hangs"] == 0 and report["errors"] == 0
                    and report["reference_errors"] == 0 and report["divergences"] == 0 and report["fallbacks"] == 0
                    and report["requests"] > 0 and hits["host"] > 0 and hits["storage"] > 0)
    return report


def add_flags(bench: argparse.ArgumentParser) -> None:
    """The soak's flags, on its `cpcache bench sglang-soak` parser; sglang-chaos
    (sglang_chaos.py) takes them too."""
    soak = bench.add_argument_group("traffic and I/O faults")
    soak.add_argument("--minutes", type=float, default=30.0, help="how long traffic runs")
    soak.add_argument("--clients", type=int, default=2, help="concurrent clients")
    soak.add_argument("--hang-s", type=float, default=120.0, help="a request unanswered this long hangs")
    soak.add_argument("--family", choices=["qwen3", "qwen3_moe"], default="qwen3", help="the model")
    soak.add_argument("--zigzag", action="store_true", help="prefill CP (zigzag) on")
    soak.add_argument("--storage", choices=["file", "mooncake"], default="file", help="storage")
    soak.add_argument("--copy-delay-ms", type=float, default=100.0,
                      help="every device<->host copy waits uniform(0, this) ms (twice on the slow rank)")
    soak.add_argument("--storage-delay-ms", type=float, default=100.0,
                      help="every storage call waits uniform(0, this) ms (twice on the slow rank)")
    soak.add_argument("--storage-fail-rate", type=float, default=0.02,
                      help="share of the slow rank's storage pages that fail (agreed misses)")


def main(args: argparse.Namespace) -> int:
    return run_reported("sglang-soak", args, run,
                        lambda report: "\n".join(f"{key}: {value}" for key, value in report.items()))


def run_reported(name: str, args: argparse.Namespace, run: Callable[[argparse.Namespace, Path], dict],
                 text: Callable[[dict], str]) -> int:
    """Run a bench in `--work-dir` (or a temporary folder, removed when it
    passed), print its report (JSON with `--json`): -> the exit code."""
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix=f"cpcache-{name}-"))
    work.mkdir(parents=True, exist_ok=True)
    report = run(args, work)
    report["work_dir"] = str(work)
    print(json.dumps(report) if args.json else text(report))
    if report["ok"] and not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    if not report["ok"]:
        print(f"{name}: FAILED (logs in {work})", file=sys.stderr)
    return 0 if report["ok"] else 1
