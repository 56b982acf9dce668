"""One rank's scheduler for `cpcache bench agreement`: a process of its own,
as real schedulers are, driving its own daemon and timing each call. It is
kept alive for the whole benchmark and driven block by block over stdin:

    python -m cpcache.tools.bench.scheduler --socket S --rank R

It prints `ready` once connected; then each stdin line is one block, a JSON
object {"bare_rpc": N, "counts": [1, 64], "steps": N, "think_ms": 10,
"transports": ["unary", "stream"]}, answered by one JSON line
{"bare_rpc": [seconds...], "steps": {"<transport>:<count>": [seconds...]}}.
Every rank must be sent the same blocks (each step is a round of all of
them). End of input ends it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable

from cpcache.client import AsyncClient
from cpcache.daemon.main import loop_factory
from cpcache.values import Reduce

WARMUP_STEPS = 3  # per case and block: the ranks line up again after the baselines ran


def votes(count: int, rank: int) -> list[tuple[int, Reduce, int]]:
    """`count` questions, the same on every rank, with rank-dependent answers."""
    return [(op, Reduce.MIN if op % 2 else Reduce.MAX, rank * 1000 + op) for op in range(1, count + 1)]


async def timed(call: Awaitable[object]) -> float:
    start = time.perf_counter()
    await call
    return time.perf_counter() - start


class Scheduler:
    def __init__(self, client: AsyncClient, rank: int) -> None:
        self.client = client
        self.rank = rank
        self.step = 0
        self.stream = client.steps_stream()

    async def block(self, spec: dict) -> dict:
        out: dict = {"bare_rpc": [], "steps": {}}
        if spec.get("bare_rpc"):
            await self.client.health()
            out["bare_rpc"] = [await timed(self.client.health()) for _ in range(spec["bare_rpc"])]
        think_s = spec.get("think_ms", 0.0) / 1000
        for transport in spec.get("transports", ["unary"]):
            send = self.client.step if transport == "unary" else self.stream.step
            for count in spec.get("counts", []):
                request = votes(count, self.rank)
                samples = []
                for _ in range(spec["steps"] + WARMUP_STEPS):
                    self.step += 1
                    samples.append(await timed(send(self.step, request)))
                    if think_s:
                        await asyncio.sleep(think_s)  # the forward pass between two steps
                out["steps"][f"{transport}:{count}"] = samples[WARMUP_STEPS:]
        return out


async def run(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async with AsyncClient(args.socket) as client:
        scheduler = Scheduler(client, args.rank)
        await client.wait_serving(120.0)  # connected, however loaded the machine is
        print("ready", flush=True)
        try:
            while line := await reader.readline():
                print(json.dumps(await scheduler.block(json.loads(line))), flush=True)
        finally:
            await scheduler.stream.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--rank", type=int, required=True)
    args = ap.parse_args()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(run(args))


if __name__ == "__main__":
    main()
