"""`cpcache bench agreement`: what one agreed round costs, against the bare
parts it is made of and against SGLang's per-question collectives, all on the
same 4 ranks (attention TP 2 x CP 2) in one run."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cpcache.bench.stats import percentiles_us
from cpcache.client import AsyncClient
from cpcache.collective import host_store
from cpcache.launcher import DomainSpec, LocalDomain
from cpcache.rounds import Reduce
from cpcache.topology import Topology

TOPOLOGY = Topology(tp=4, cp=2)
QUESTION_COUNTS = (1, 64, 256, 1024)
FORWARD_PASS_S = 0.010


def gloo_baselines() -> dict:
    store = host_store()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "cpcache.bench.gloo_baseline", "--rank", str(r), "--tp", str(TOPOLOGY.tp),
             "--cp", str(TOPOLOGY.cp), "--port", str(store.port)],
            stdout=subprocess.PIPE, text=True,
        )
        for r in range(TOPOLOGY.world_size)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"gloo baseline failed: exit codes {[p.returncode for p in procs]}")
    return json.loads(outputs[0])


def votes(count: int, rank: int) -> list[tuple[int, Reduce, int]]:
    return [(op, Reduce.MIN if op % 2 else Reduce.MAX, rank * 1000 + op) for op in range(1, count + 1)]


async def measure_steps(clients, count: int, steps: int, first_step: int, think_s: float = 0.0) -> list[float]:
    """Latency of each rank's Step call, as its scheduler sees it."""
    requests = [votes(count, r) for r in range(len(clients))]

    async def one(client, step, request):
        start = time.perf_counter()
        await client.step(step, request)
        return time.perf_counter() - start

    samples: list[float] = []
    for i in range(steps):
        step = first_step + i
        results = await asyncio.gather(*(one(c, step, req) for c, req in zip(clients, requests)))
        if i >= 5:  # warm-up
            samples.extend(results)
        if think_s:
            await asyncio.sleep(think_s)  # the forward pass the scheduler would run
    return samples


async def bare_rpc(client: AsyncClient, calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        await client.health()
        samples.append(time.perf_counter() - start)
    return samples[10:]


async def run(steps: int) -> dict:
    baselines = gloo_baselines()
    report: dict = {"ranks": TOPOLOGY.world_size, "topology": TOPOLOGY.describe(), "steps_per_case": steps}
    with tempfile.TemporaryDirectory(prefix="cpc-bench-") as tmp:
        async with LocalDomain(DomainSpec(TOPOLOGY, Path(tmp) / "lag0")) as domain:
            clients = [AsyncClient(s) for s in domain.sockets]
            report["bare_rpc_us"] = percentiles_us(await bare_rpc(clients[0], steps + 10))
            report["round_us"] = {}
            step = 1
            for count in QUESTION_COUNTS:
                samples = await measure_steps(clients, count, steps, step)
                step += steps
                report["round_us"][str(count)] = percentiles_us(samples)
            for c in clients:
                await c.close()
        async with LocalDomain(DomainSpec(TOPOLOGY, Path(tmp) / "lag1", agreement_lag=1)) as domain:
            clients = [AsyncClient(s) for s in domain.sockets]
            samples = await measure_steps(clients, 256, steps, 1, think_s=FORWARD_PASS_S)
            report["lag1_round_us"] = percentiles_us(samples)
            for c in clients:
                await c.close()
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


async def main(args) -> int:
    report = await run(args.steps)
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
    return 0
