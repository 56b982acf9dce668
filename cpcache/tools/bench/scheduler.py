"""One rank's scheduler for `cpcache bench agreement`: a process of its own,
as real schedulers are, driving its own daemon and timing each call.

    python -m cpcache.tools.bench.scheduler --socket S --rank R --counts 1,64 --steps N [--think-ms 10]

Prints one JSON object: {"bare_rpc": [seconds...], "steps": {"<count>": [seconds...]}}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable

from cpcache.client import AsyncClient
from cpcache.daemon.main import loop_factory
from cpcache.values import Reduce

WARMUP_STEPS = 10


def votes(count: int, rank: int) -> list[tuple[int, Reduce, int]]:
    """`count` questions, the same on every rank, with rank-dependent answers."""
    return [(op, Reduce.MIN if op % 2 else Reduce.MAX, rank * 1000 + op) for op in range(1, count + 1)]


async def timed(call: Awaitable[object]) -> float:
    start = time.perf_counter()
    await call
    return time.perf_counter() - start


async def run(args: argparse.Namespace) -> dict:
    out: dict = {"bare_rpc": [], "steps": {}}
    async with AsyncClient(args.socket) as client:
        step = 0
        for _ in range(WARMUP_STEPS):  # connect, and line up with the other ranks
            step += 1
            await client.step(step, [])
        if args.bare_rpc:
            out["bare_rpc"] = [await timed(client.health()) for _ in range(args.steps)]
        for count in args.counts:
            request = votes(count, args.rank)
            samples = []
            for _ in range(args.steps + WARMUP_STEPS):
                step += 1
                samples.append(await timed(client.step(step, request)))
                if args.think_ms:
                    await asyncio.sleep(args.think_ms / 1000)  # the forward pass between two steps
            out["steps"][str(count)] = samples[WARMUP_STEPS:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--counts", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--think-ms", type=float, default=0.0)
    ap.add_argument("--bare-rpc", action="store_true", help="also time bare health calls")
    args = ap.parse_args()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        print(json.dumps(runner.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
