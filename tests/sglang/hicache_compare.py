"""SGLang's own HiCache on this CPU host (hicache.HICACHE_FLAGS, HICACHE_ENV)
beside a `--disable-radix-cache` server: the same workload to both, every
reply compared, hits per pass reported. A measurement, not a test:

    .venv/bin/python -m tests.sglang.hicache_compare --tp 1 --port 30210

Workload: a 64-token system prompt shared by 10 documents of 256 random
tokens (prompt = system + doc + [turn + 1, doc + 1]), sent in order, then in
reverse order; device pool 1024 tokens, page 16. Exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

from cpcache.testing.sglang_cpu.hicache import HICACHE_ENV, HICACHE_FLAGS
from cpcache.testing.sglang_cpu.servers import (
    PLAIN_FLAGS,
    Reply,
    Server,
    make_tiny_model,
    same_outputs,
)


def prompts(seed: int = 1234) -> list[tuple[int, int, list[int]]]:
    """(pass, doc, prompt) in sending order."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 500) for _ in range(64)]
    docs = [[rng.randrange(1, 500) for _ in range(256)] for _ in range(10)]
    order = [list(range(10)), list(range(9, -1, -1))]
    return [(turn, d, system + docs[d] + [turn + 1, d + 1]) for turn in range(2) for d in order[turn]]


def run(server: Server, work: list[tuple[int, int, list[int]]]) -> list[Reply]:
    server.start()
    try:
        server.wait_ready()
        return [server.generate(prompt) for _, _, prompt in work]
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--port", type=int, default=0, help="the HiCache server's; the plain one's is +1")
    args = parser.parse_args()
    work = prompts()
    with tempfile.TemporaryDirectory(prefix="hicache-compare-") as tmp:
        root = Path(tmp)
        model = make_tiny_model(root / "tiny")
        hicache = run(Server("hicache", model, root, HICACHE_FLAGS, tp=args.tp, env=HICACHE_ENV,
                             port=args.port), work)
        plain = run(Server("plain", model, root, PLAIN_FLAGS, tp=args.tp, port=args.port + 1 if args.port else 0),
                    work)
    mismatches = 0
    for (turn, doc, prompt), h, p in zip(work, hicache, plain):
        same = same_outputs(h, p)
        mismatches += not same
        print(f"pass {turn} doc {doc}: prompt {len(prompt)} cached {h.cached} (device {h.device}, host {h.host}) "
              f"{'same' if same else f'DIFFERENT: {h} vs {p}'}")
    for turn in range(2):
        rows = [(prompt, h) for (t, _, prompt), h in zip(work, hicache) if t == turn]
        cached = sum(h.cached for _, h in rows)
        total = sum(len(prompt) for prompt, _ in rows)
        print(f"tp {args.tp} pass {turn}: hit rate {cached}/{total} = {cached / total:.3f}, "
              f"device {sum(h.device for _, h in rows)}, host {sum(h.host for _, h in rows)} tokens")
    host_hits = sum(h.host for (t, _, _), h in zip(work, hicache) if t == 1)
    print(f"{len(work) - mismatches}/{len(work)} replies equal to the plain server's; "
          f"second-pass host hits {host_hits}")
    return 1 if mismatches or not host_hits else 0


if __name__ == "__main__":
    sys.exit(main())
