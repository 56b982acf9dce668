"""Baselines for `cpcache bench ranks`, over the same ranks and vector size a
round uses, without cpcache: a bare gloo all-reduce (MIN) of an int64
vector, and the daemons' own reduction of it (`GroupReducer.min_inplace`:
an all-to-all exchange and a local MIN, up to `ALLTOALL_MAX_GROUP` ranks) on
a group built the way the daemons build theirs. One process per rank, kept
alive for the whole benchmark and driven block by block over stdin:

    python -m cpcache.tools.bench.vector_baseline --rank R --tp 8 --cp 2 --port P

It prints `ready` once its group is up; then each stdin line `ITERATIONS
LENGTH [WHICH]` (WHICH: `both`, the default, `allreduce` or `exchange`) runs
one block and prints one JSON line {"allreduce": [seconds...], "exchange":
[seconds...]}. Every rank must be sent the same lines (they are
collectives). End of input ends it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.distributed import AllreduceOptions, ReduceOp, Work

from cpcache.agreement.collective import GroupReducer, Rendezvous, gloo_group, reducer_groups
from cpcache.topology import Topology

WARMUP = 3  # per block and case, discarded: the ranks line up again after the other processes' block


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait")
    args = ap.parse_args()

    topology = Topology(tp=args.tp, cp=args.cp)
    rdzv = Rendezvous("127.0.0.1", args.port, "bench-ranks", timeout_s=args.timeout)
    (group,) = reducer_groups(topology, args.rank, "domain")
    pg = gloo_group(rdzv.connect(), rdzv, group, args.rank, args.timeout, "127.0.0.1")
    reducer = GroupReducer([pg])
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp(ReduceOp.MIN)
    # Backend's collectives are bound at runtime but absent from torch's stub.
    allreduce: Callable[[list[torch.Tensor], AllreduceOptions], Work] = pg.allreduce  # type: ignore[attr-defined]

    warm = np.zeros(8, dtype=np.int64)
    for _ in range(WARMUP):  # connect every pair before the first block
        allreduce([torch.from_numpy(warm)], opts).wait()
        reducer.min_inplace(warm)
    print("ready", flush=True)

    for line in sys.stdin:
        fields = line.split()
        iterations, length = int(fields[0]), int(fields[1])
        which = fields[2] if len(fields) > 2 else "both"
        out: dict[str, list[float]] = {"allreduce": [], "exchange": []}
        vector = np.full(length, args.rank, dtype=np.int64)
        tensor = torch.from_numpy(vector)
        if which in ("both", "allreduce"):
            for i in range(iterations + WARMUP):
                start = time.perf_counter()
                allreduce([tensor], opts).wait()
                if i >= WARMUP:
                    out["allreduce"].append(time.perf_counter() - start)
        if which in ("both", "exchange"):
            for i in range(iterations + WARMUP):
                start = time.perf_counter()
                reducer.min_inplace(vector)
                if i >= WARMUP:
                    out["exchange"].append(time.perf_counter() - start)
        print(json.dumps(out), flush=True)
    reducer.close()


if __name__ == "__main__":
    main()
