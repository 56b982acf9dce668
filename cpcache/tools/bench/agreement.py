"""`cpcache bench agreement`: what one agreed round costs, against the bare
parts it is made of and against SGLang's per-question collectives, all on the
same 4 ranks (attention TP 2 x CP 2) in one run.

Candidate and baselines run in blocks, one after the other, `--repeat` times:
a block of the gloo baselines (bare all-reduce, SGLang-style decisions), then
a block of scheduler steps (bare RPC, then rounds of 1 to 1024 questions, by
unary `Step` and by the `Steps` stream). Every process stays up between
blocks, so a block costs only what it measures. Each ratio is taken per block
(its two sides measured in the same minute) and reported as the median over
the blocks, with its spread; the pooled percentiles of every figure are kept
as before. The lag-1 case runs in a second domain (`agreement_lag = 1`), in
blocks of bare RPC and lag-1 steps."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from cpcache.agreement.collective import host_store
from cpcache.client import AsyncClient
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.testing.stats import block_summary, percentiles_us
from cpcache.topology import Topology

TOPOLOGY = Topology(tp=4, cp=2)
QUESTION_COUNTS = (1, 64, 256, 1024)
TRANSPORTS = ("unary", "stream")
FORWARD_PASS_S = 0.010  # what a scheduler spends between two steps in the lag-1 case
BARE_ALLREDUCES_PER_BLOCK = 100
SGLANG_STEPS_PER_BLOCK = 1  # 512 one-int all-reduces: a few hundred ms
READY_TIMEOUT_S = 120.0
BLOCK_TIMEOUT_S = 600.0


class Workers:
    """One long-lived process per rank, driven a block at a time over stdin:
    every process gets the same line, and answers one JSON line."""

    def __init__(self, procs: list[asyncio.subprocess.Process], what: str) -> None:
        self._procs = procs
        self._what = what

    @classmethod
    async def start(cls, argvs: Sequence[Sequence[str]], what: str) -> Workers:
        procs = [await asyncio.create_subprocess_exec(sys.executable, "-m", *argv, stdin=asyncio.subprocess.PIPE,
                                                      stdout=asyncio.subprocess.PIPE) for argv in argvs]
        workers = cls(procs, what)
        lines = await workers._read_all(READY_TIMEOUT_S)
        if any(line.strip() != b"ready" for line in lines):
            await workers.stop()
            raise RuntimeError(f"{what}: a worker did not start: {lines}")
        return workers

    async def _read_all(self, timeout_s: float) -> list[bytes]:
        async def one(p: asyncio.subprocess.Process) -> bytes:
            assert p.stdout is not None
            return await p.stdout.readline()
        return list(await asyncio.wait_for(asyncio.gather(*(one(p) for p in self._procs)), timeout_s))

    async def block(self, line: str) -> list[dict]:
        for p in self._procs:
            assert p.stdin is not None
            p.stdin.write(line.encode() + b"\n")
        for p in self._procs:
            assert p.stdin is not None
            await p.stdin.drain()
        lines = await self._read_all(BLOCK_TIMEOUT_S)
        if any(not line for line in lines):
            codes = [p.returncode for p in self._procs]
            raise RuntimeError(f"{self._what}: a worker ended mid-block (exit codes {codes})")
        return [json.loads(line) for line in lines]

    async def stop(self) -> None:
        for p in self._procs:
            if p.stdin is not None and not p.stdin.is_closing():
                p.stdin.close()
        codes = [await asyncio.wait_for(p.wait(), 60.0) for p in self._procs]
        if any(codes):
            raise RuntimeError(f"{self._what}: exit codes {codes}")


async def gloo_workers() -> tuple[Workers, object]:
    store = host_store()
    workers = await Workers.start(
        [["cpcache.tools.bench.gloo_baseline", "--rank", str(r), "--tp", str(TOPOLOGY.tp), "--cp", str(TOPOLOGY.cp),
          "--port", str(store.port)] for r in range(TOPOLOGY.world_size)], "gloo baseline")
    return workers, store  # the store must outlive the workers' group


async def scheduler_workers(domain: LocalDomain) -> Workers:
    return await Workers.start([["cpcache.tools.bench.scheduler", "--socket", socket, "--rank", str(rank)]
                                for rank, socket in enumerate(domain.sockets)], "scheduler")


def pooled(outputs: list[dict], key: str) -> list[float]:
    return [s for o in outputs for s in o[key]]


def pooled_steps(outputs: list[dict], case: str) -> list[float]:
    return [s for o in outputs for s in o["steps"][case]]


def p50(samples: list[float]) -> float:
    return statistics.median(samples)


async def idle_rpc(socket: str, calls: int) -> list[float]:
    """A bare call with nothing else running: for reference only."""
    samples = []
    async with AsyncClient(socket) as client:
        for _ in range(calls + 10):
            start = time.perf_counter()
            await client.health()
            samples.append(time.perf_counter() - start)
    return samples[10:]


async def run(steps: int, repeat: int) -> dict:
    report: dict = {"ranks": TOPOLOGY.world_size, "topology": TOPOLOGY.describe(), "steps_per_case": steps * repeat,
                    "blocks": repeat, "steps_per_block": steps}
    samples: dict[str, list[float]] = {}
    per_block: dict[str, list[float]] = {}

    def keep(name: str, values: list[float]) -> float:
        samples.setdefault(name, []).extend(values)
        return p50(values)

    def ratio(name: str, value: float) -> None:
        per_block.setdefault(name, []).append(value)

    gloo, store = await gloo_workers()
    try:
        with tempfile.TemporaryDirectory(prefix="cpc-bench-") as tmp:
            async with LocalDomain(DomainSpec(TOPOLOGY, Path(tmp) / "lag0")) as domain:
                report["bare_rpc_idle_us"] = percentiles_us(await idle_rpc(domain.sockets[0], steps))
                schedulers = await scheduler_workers(domain)
                spec = json.dumps({"bare_rpc": steps, "counts": QUESTION_COUNTS, "steps": steps,
                                   "transports": TRANSPORTS})
                for _ in range(repeat):
                    base = await gloo.block(f"{BARE_ALLREDUCES_PER_BLOCK} {SGLANG_STEPS_PER_BLOCK}")
                    bare_allreduce = keep("bare_allreduce", pooled(base, "bare"))
                    sglang = keep("sglang_style", pooled(base, "sglang"))
                    out = await schedulers.block(spec)
                    bare_rpc = keep("bare_rpc", pooled(out, "bare_rpc"))
                    rounds = {f"{t}:{c}": keep(f"{t}:{c}", pooled_steps(out, f"{t}:{c}"))
                              for t in TRANSPORTS for c in QUESTION_COUNTS}
                    for t, suffix in (("unary", ""), ("stream", "_stream")):
                        ratio(f"sglang_256_over_round_256{suffix}", sglang / rounds[f"{t}:256"])
                        ratio(f"round_1_over_bare_allreduce_plus_rpc{suffix}",
                              rounds[f"{t}:1"] / (bare_allreduce + bare_rpc))
                        ratio(f"round_1024_over_round_1{suffix}", rounds[f"{t}:1024"] / rounds[f"{t}:1"])
                await schedulers.stop()
            async with LocalDomain(DomainSpec(TOPOLOGY, Path(tmp) / "lag1", agreement_lag=1)) as domain:
                schedulers = await scheduler_workers(domain)
                spec = json.dumps({"bare_rpc": steps, "counts": [256], "steps": steps, "transports": TRANSPORTS,
                                   "think_ms": FORWARD_PASS_S * 1000})
                for _ in range(repeat):
                    out = await schedulers.block(spec)
                    bare_rpc = keep("lag1_bare_rpc", pooled(out, "bare_rpc"))
                    for t, suffix in (("unary", ""), ("stream", "_stream")):
                        lag1 = keep(f"lag1_{t}", pooled_steps(out, f"{t}:256"))
                        ratio(f"lag1_over_bare_rpc{suffix}", lag1 / bare_rpc)
                await schedulers.stop()
    finally:
        await gloo.stop()
        del store

    report["bare_rpc_us"] = percentiles_us(samples["bare_rpc"])
    report["round_us"] = {str(c): percentiles_us(samples[f"unary:{c}"]) for c in QUESTION_COUNTS}
    report["round_stream_us"] = {str(c): percentiles_us(samples[f"stream:{c}"]) for c in QUESTION_COUNTS}
    report["lag1_round_us"] = percentiles_us(samples["lag1_unary"])
    report["lag1_stream_round_us"] = percentiles_us(samples["lag1_stream"])
    report["lag1_bare_rpc_us"] = percentiles_us(samples["lag1_bare_rpc"])
    report["bare_allreduce_us"] = percentiles_us(samples["bare_allreduce"])
    report["sglang_style_256_us"] = percentiles_us(samples["sglang_style"])
    digits = {"sglang_256_over_round_256": 1}
    summaries = {name: block_summary(values, digits.get(name.removesuffix("_stream"), 2))
                 for name, values in per_block.items()}
    # Each ratio is the median over the blocks (its spread: `ratio_spread`).
    report["ratios"] = {name: s["median"] for name, s in summaries.items()}
    report["ratio_spread"] = summaries
    r = report["ratios"]
    report["targets_met"] = {
        "sglang_256_over_round_256 >= 100": r["sglang_256_over_round_256"] >= 100,
        "round_1_over_bare_allreduce_plus_rpc <= 1.5": r["round_1_over_bare_allreduce_plus_rpc"] <= 1.5,
        "round_1024_over_round_1 <= 2": r["round_1024_over_round_1"] <= 2,
        "lag1_over_bare_rpc <= 1.2": r["lag1_over_bare_rpc"] <= 1.2,
        "lag1_stream_over_bare_rpc <= 1.2": r["lag1_over_bare_rpc_stream"] <= 1.2,
    }
    return report


async def main(args: argparse.Namespace) -> int:
    report = await run(args.steps, args.repeat)
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
    return 0
