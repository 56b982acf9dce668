"""The turns of one session sent at once, each prompt extending the one
before (as SGLang's `bench_serving --dataset-name mooncake` sends a
session): does a server find a later turn's prefix cached, that is, is the
later turn scheduled after the earlier one's prefill entered its tree?

One tp 2 / attention CP 2 server of each kind (SGLang's radix cache, its
HiCache on files, cpcache over `cpcache launch` daemons on files; a tiny
random Qwen3), measured one at a time, the others paused: SESSIONS
sessions of three turns (96 tokens, then 64 more, then 64 more), each
session's turns sent together from three threads. Prints the cached tokens
of every turn, per server.

    PYTHONPATH=$PWD .venv/bin/python scripts/session_turns_at_once.py WORK_DIR
"""

from __future__ import annotations

import json
import random
import sys
import threading
from pathlib import Path

from cpcache.testing.sglang_cpu.hicache import HICACHE_ENV, HICACHE_FLAGS, hicache_file_storage_flags
from cpcache.testing.sglang_cpu.servers import Reply, Server, make_tiny_model, start_paused
from cpcache.testing.sglang_cpu.stacks import DEVICE_TOKENS, PAGE, Shape, Stack

SESSIONS = 6
FIRST, LATER = 96, 64


def sessions(seed: int = 3) -> list[list[list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(SESSIONS):
        turns = [[rng.randrange(1, 500) for _ in range(FIRST)]]
        for _ in range(2):
            turns.append(turns[-1] + [rng.randrange(1, 500) for _ in range(LATER)])
        out.append(turns)
    return out


def at_once(server: Server, turns: list[list[int]]) -> list[int]:
    """-> each turn's cached tokens, the turns sent together."""
    replies: list[Reply | None] = [None] * len(turns)

    def send(i: int) -> None:
        replies[i] = server.generate(turns[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(turns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r.cached if r is not None else -1 for r in replies]


def main(work: Path) -> dict[str, list[list[int]]]:
    work.mkdir(parents=True, exist_ok=True)
    shape = Shape("qwen3", tp=2, cp=2, storage="file")
    model = make_tiny_model(work / "qwen3", shape.family)
    stack = Stack(work, model, shape, copy_delay_ms=0.0, storage_delay_ms=0.0, per_rank={}, with_reference=False)
    common = dict(model=model, work=work, tp=shape.tp, cp=shape.cp, page_size=PAGE, device_tokens=DEVICE_TOKENS)
    servers = {"radix": Server("radix", flags=[], **common),
               "hicache": Server("hicache", flags=[*HICACHE_FLAGS, *hicache_file_storage_flags(work / "hicache")],
                                 env=HICACHE_ENV, **common),
               "cpcache": stack.cpcache}
    cached: dict[str, list[list[int]]] = {}
    try:
        stack.daemons.start()
        start_paused(servers.values())
        for name, server in servers.items():
            assert server.process is not None
            server.process.resume()
            cached[name] = [at_once(server, turns) for turns in sessions()]
            server.process.pause()
    finally:
        for server in servers.values():
            server.stop()
        stack.daemons.stop()
    return cached


if __name__ == "__main__":
    found = main(Path(sys.argv[1]))
    for name, rows in found.items():
        print(f"{name}: {sum(any(c > 0 for c in row[1:]) for row in rows)} of {len(rows)} sessions found an "
              f"earlier turn cached; per turn: {rows}")
    print(json.dumps(found))
