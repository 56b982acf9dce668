"""`cpcache demo`: launch a local 4-rank domain (attention TP 2 x CP 2) and
drive it with one scheduler per rank, each with its own local answers, then
report whether every rank received the same decisions."""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

from cpcache.bench.stats import percentiles_us
from cpcache.client import AsyncClient
from cpcache.launcher import DomainSpec, LocalDomain
from cpcache.rounds import Reduce
from cpcache.topology import Topology


async def run(args) -> dict:
    topology = Topology(tp=args.tp, cp=args.cp, dp=args.dp, pp=args.pp)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="cpc-demo-") as tmp:
        spec = DomainSpec(topology, Path(tmp), mode=args.mode, agreement_lag=args.lag,
                          fault_delay_ms=args.fault_delay_ms, seed=args.seed)
        print(f"launching {topology.world_size} daemons ({topology.describe()}, {args.mode} mode, lag {args.lag})",
              flush=True)
        async with LocalDomain(spec) as domain:
            clients = [AsyncClient(s) for s in domain.sockets]
            divergences, decisions, latencies = 0, 0, []
            logs: list[list[bytes]] = [[] for _ in clients]
            op = 0
            for step in range(1, args.steps + 1):
                count = rng.choice([0, 1, 4, 16, 64])
                ops = [(op + i, rng.choice([Reduce.MIN, Reduce.MAX])) for i in range(count)]
                op += count
                local = [[(o, red, rng.randint(0, 1 << 20)) for o, red in ops] for _ in clients]
                start = time.perf_counter()
                replies = await asyncio.gather(*(c.step(step, v) for c, v in zip(clients, local)))
                latencies.append(time.perf_counter() - start)
                for log, reply in zip(logs, replies):
                    log.append(reply.wire)
                divergences += len({r.wire for r in replies}) > 1
                decisions += len(replies[0].decisions)
                if step % max(1, args.steps // 10) == 0:
                    print(f"  step {step}/{args.steps}: {decisions} decisions agreed, {divergences} divergences",
                          flush=True)
            for c in clients:
                await c.close()
    return {
        "ranks": topology.world_size,
        "steps": args.steps,
        "decisions": decisions,
        "divergences": divergences,
        "identical_decision_logs": all(log == logs[0] for log in logs),
        "round_latency_us": percentiles_us(latencies),
    }


async def main(args) -> int:
    report = await run(args)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0 if report["divergences"] == 0 and report["identical_decision_logs"] else 1
