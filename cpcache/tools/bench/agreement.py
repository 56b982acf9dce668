"""`cpcache bench agreement`: what one agreed round costs, against the bare
parts it is made of and against SGLang's per-question collectives, all on the
same 4 ranks (attention TP 2 x CP 2) in one run."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TypedDict

from cpcache.agreement.collective import host_store
from cpcache.client import AsyncClient
from cpcache.tools.bench.stats import percentiles_us
from cpcache.tools.launcher import DomainSpec, LocalDomain
from cpcache.topology import Topology

TOPOLOGY = Topology(tp=4, cp=2)
QUESTION_COUNTS = (1, 64, 256, 1024)
FORWARD_PASS_S = 0.010  # what a scheduler spends between two steps in the lag-1 case


class Pooled(TypedDict):
    bare_rpc: list[float]  # seconds
    steps: dict[int, list[float]]  # question count -> seconds


def gloo_baselines() -> dict:
    store = host_store()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "cpcache.tools.bench.gloo_baseline", "--rank", str(r), "--tp", str(TOPOLOGY.tp),
             "--cp", str(TOPOLOGY.cp), "--port", str(store.port)],
            stdout=subprocess.PIPE, text=True,
        )
        for r in range(TOPOLOGY.world_size)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"gloo baseline failed: exit codes {[p.returncode for p in procs]}")
    return json.loads(outputs[0])


async def schedulers(domain: LocalDomain, counts: Sequence[int], steps: int, think_ms: float = 0.0,
                     bare_rpc: bool = False) -> Pooled:
    """Run one scheduler process per rank against `domain`; pool their samples."""
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "cpcache.tools.bench.scheduler", "--socket", socket, "--rank", str(rank),
            "--counts", ",".join(map(str, counts)), "--steps", str(steps), "--think-ms", str(think_ms),
            *(["--bare-rpc"] if bare_rpc else []),
            stdout=asyncio.subprocess.PIPE,
        )
        for rank, socket in enumerate(domain.sockets)
    ]
    outputs = [json.loads((await p.communicate())[0]) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a scheduler failed: exit codes {[p.returncode for p in procs]}")
    return {
        "bare_rpc": [s for o in outputs for s in o["bare_rpc"]],
        "steps": {c: [s for o in outputs for s in o["steps"][str(c)]] for c in counts},
    }


async def idle_rpc(socket: str, calls: int) -> list[float]:
    """A bare call with nothing else running: for reference only."""
    samples = []
    async with AsyncClient(socket) as client:
        for _ in range(calls + 10):
            start = time.perf_counter()
            await client.health()
            samples.append(time.perf_counter() - start)
    return samples[10:]


async def run(steps: int) -> dict:
    baselines = gloo_baselines()
    report: dict = {"ranks": TOPOLOGY.world_size, "topology": TOPOLOGY.describe(), "steps_per_case": steps}
    with tempfile.TemporaryDirectory(prefix="cpc-bench-") as tmp:
        async with LocalDomain(DomainSpec(TOPOLOGY, Path(tmp) / "lag0")) as domain:
            report["bare_rpc_idle_us"] = percentiles_us(await idle_rpc(domain.sockets[0], steps))
            pooled = await schedulers(domain, QUESTION_COUNTS, steps, bare_rpc=True)
            report["bare_rpc_us"] = percentiles_us(pooled["bare_rpc"])
            report["round_us"] = {str(c): percentiles_us(pooled["steps"][c]) for c in QUESTION_COUNTS}
        async with LocalDomain(DomainSpec(TOPOLOGY, Path(tmp) / "lag1", agreement_lag=1)) as domain:
            pooled = await schedulers(domain, [256], steps, think_ms=FORWARD_PASS_S * 1000)
            report["lag1_round_us"] = percentiles_us(pooled["steps"][256])
    report["bare_allreduce_us"] = baselines["bare_allreduce"]
    report["sglang_style_256_us"] = baselines["sglang_style"]
    r = report["round_us"]
    bare_sum = report["bare_allreduce_us"]["p50"] + report["bare_rpc_us"]["p50"]
    report["ratios"] = {
        "sglang_256_over_round_256": round(report["sglang_style_256_us"]["p50"] / r["256"]["p50"], 1),
        "round_1_over_bare_allreduce_plus_rpc": round(r["1"]["p50"] / bare_sum, 2),
        "round_1024_over_round_1": round(r["1024"]["p50"] / r["1"]["p50"], 2),
        "lag1_over_bare_rpc": round(report["lag1_round_us"]["p50"] / report["bare_rpc_us"]["p50"], 2),
    }
    report["targets_met"] = {
        "sglang_256_over_round_256 >= 100": report["ratios"]["sglang_256_over_round_256"] >= 100,
        "round_1_over_bare_allreduce_plus_rpc <= 1.5": report["ratios"]["round_1_over_bare_allreduce_plus_rpc"] <= 1.5,
        "round_1024_over_round_1 <= 2": report["ratios"]["round_1024_over_round_1"] <= 2,
        "lag1_over_bare_rpc <= 1.2": report["ratios"]["lag1_over_bare_rpc"] <= 1.2,
    }
    return report


async def main(args: argparse.Namespace) -> int:
    report = await run(args.steps)
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
    return 0
