"""Baselines over the same ranks, without cpcache: a bare gloo all-reduce,
and SGLang's way of deciding N questions (two all-reduces per question per
step). Run as one process per rank, kept alive for the whole benchmark and
driven block by block over stdin, so the baselines are measured between the
candidate's blocks, in the same minutes:

    python -m cpcache.tools.bench.gloo_baseline --rank R --tp 4 --cp 2 --port P

It prints `ready` once its group is up; then each stdin line `ITERATIONS
SGLANG_STEPS` runs one block and prints one JSON line, {"bare": [seconds...],
"sglang": [seconds...]}. Every rank must be sent the same lines (they are
collectives). End of input ends it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import torch
from torch.distributed import AllreduceOptions, ReduceOp, Work

from cpcache.agreement.collective import Rendezvous, gloo_group, reducer_groups
from cpcache.topology import Topology


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--questions", type=int, default=256)
    args = ap.parse_args()

    topology = Topology(tp=args.tp, cp=args.cp)
    rdzv = Rendezvous("127.0.0.1", args.port, "bench-baseline")
    (group,) = reducer_groups(topology, args.rank, "domain")
    pg = gloo_group(rdzv.connect(), rdzv, group, args.rank, 60.0, "127.0.0.1")
    opts_min = AllreduceOptions()
    opts_min.reduceOp = ReduceOp(ReduceOp.MIN)
    opts_max = AllreduceOptions()
    opts_max.reduceOp = ReduceOp(ReduceOp.MAX)
    # Backend's collectives are bound at runtime but absent from torch's stub.
    allreduce: Callable[[list[torch.Tensor], AllreduceOptions], Work] = pg.allreduce  # type: ignore[attr-defined]

    small = torch.zeros(1, dtype=torch.int64)
    for _ in range(20):  # warm up connections
        allreduce([small], opts_min).wait()
    print("ready", flush=True)

    for line in sys.stdin:
        iterations, sglang_steps = (int(x) for x in line.split())
        bare = []
        for _ in range(iterations):
            start = time.perf_counter()
            allreduce([small], opts_min).wait()
            bare.append(time.perf_counter() - start)
        # SGLang-style: per question, one all-reduce of its progress (MIN) and
        # one of its termination vote (MAX), every step.
        sglang = []
        for _ in range(sglang_steps):
            start = time.perf_counter()
            for _ in range(args.questions):
                progress = torch.tensor([args.rank], dtype=torch.int64)
                allreduce([progress], opts_min).wait()
                vote = torch.tensor([1], dtype=torch.int64)
                allreduce([vote], opts_max).wait()
            sglang.append(time.perf_counter() - start)
        print(json.dumps({"bare": bare, "sglang": sglang}), flush=True)
    pg.shutdown()


if __name__ == "__main__":
    main()
