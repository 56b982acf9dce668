"""The driver of compose's `cpu` profile: `python -m cpcache.testing.compose_driver`.

It runs in its own container beside one container per daemon and reaches
each daemon through its unix socket on a shared volume (the daemons reduce
over gloo across the bridge network). Two phases, each ending in one JSON
line on stdout (progress goes to stderr):

1. `replay`: waits until every rank serves, replays a trace slice through
   one simulated scheduler per rank (`cpcache.testing.sim.replay`: the same
   schedulers and checks as `cpcache demo`) and reports it. It passes when
   there are 0 divergences, every rank's decision log is identical and no
   load-back brought a wrong byte.
2. `kill` (unless `--no-kill-check`): prints `{"phase": "ready-for-kill",
   "fifo": PATH}`, then waits on that FIFO for a line `RANK KILLED_AT` from
   whoever killed RANK's container (`KILLED_AT`: Unix time, the same clock in
   every container of a host). It then sends every survivor its next step
   and passes when each answers `UNAVAILABLE` (`PeerLost`) naming exactly
   that rank; it reports how long after the kill each answer came.

Exit status: 0 when every phase that ran passed, 1 otherwise, 2 on bad
arguments or when the daemons did not serve in time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from cpcache import errors
from cpcache.client import AsyncClient
from cpcache.daemon.launcher import private_run_dir
from cpcache.testing.sim.replay import ReplayConfig, _drive
from cpcache.testing.sim.trace import load
from cpcache.topology import Topology


class ComposeDomain:
    """The daemons of the stack, as the replay sees a domain: their sockets."""

    def __init__(self, sockets: list[str]) -> None:
        self.sockets = sockets


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def progress(p: dict) -> None:
    print(f"  {p['requests']:>6}/{p['of']} requests  {p['steps']:>5} steps  divergences {p['divergences']}  "
          f"{p['elapsed_s']:6.1f}s", file=sys.stderr, flush=True)


async def wait_serving(sockets: list[str], timeout_s: float) -> float:
    """Wait until every daemon reports SERVING (health watch, no polling)."""
    started = time.monotonic()

    async def one(path: str) -> None:
        async with AsyncClient(path) as client:
            await client.wait_serving(timeout_s)

    await asyncio.gather(*(one(path) for path in sockets))
    return time.monotonic() - started


async def replay_phase(args: argparse.Namespace, sockets: list[str], work: Path) -> tuple[dict, int]:
    cfg = ReplayConfig(trace=Path(args.trace), requests=args.requests, skip=args.skip,
                       topology=Topology(tp=args.tp, cp=args.cp), storage=args.storage,
                       device_pages=args.device_pages, batch=args.batch)
    requests = load(cfg.trace, cfg.requests, cfg.skip)
    report = await _drive(cfg, ComposeDomain(sockets), requests, work, progress)  # type: ignore[arg-type]
    for series in ("per_step_latency_s", "per_step_hit_rate"):
        report.pop(series, None)
    report["passed"] = (report["divergences"] == 0 and report["identical_decision_logs"]
                        and report["corrupt_loads"] == 0 and report["requests"] == len(requests))
    return report, int(report["steps"])


def read_kill(fifo: Path) -> tuple[int, float]:
    """Block until the killer writes `RANK KILLED_AT` into the FIFO."""
    with open(fifo) as fh:
        rank, killed_at = fh.readline().split()
    return int(rank), float(killed_at)


async def kill_phase(args: argparse.Namespace, sockets: list[str], work: Path, last_step: int) -> dict:
    fifo = work / "killed"
    with contextlib.suppress(FileNotFoundError):
        fifo.unlink()
    os.mkfifo(fifo, 0o600)
    emit({"phase": "ready-for-kill", "fifo": str(fifo), "last_step": last_step})
    killed, killed_at = await asyncio.wait_for(asyncio.to_thread(read_kill, fifo), args.kill_wait_s)
    survivors = [rank for rank in range(len(sockets)) if rank != killed]

    async def ask(rank: int) -> dict[str, Any]:
        async with AsyncClient(sockets[rank], timeout_s=args.unavailable_within_s) as client:
            try:
                await client.step(last_step + 1)
            except errors.PeerLost as exc:
                return {"status": "UNAVAILABLE", "missing_ranks": list(exc.missing_ranks),
                        "after_kill_s": round(time.time() - killed_at, 3), "message": str(exc)}
            except errors.CacheError as exc:
                return {"status": f"{exc.status} ({type(exc).__name__})",
                        "after_kill_s": round(time.time() - killed_at, 3), "message": str(exc)}
            return {"status": "OK", "after_kill_s": round(time.time() - killed_at, 3)}

    answers = await asyncio.gather(*(ask(rank) for rank in survivors))
    by_rank = dict(zip(survivors, answers))
    passed = all(a["status"] == "UNAVAILABLE" and a["missing_ranks"] == [killed] for a in answers)
    return {"phase": "kill", "killed": killed, "survivors": by_rank, "passed": passed,
            "slowest_after_kill_s": max(a["after_kill_s"] for a in answers)}


async def main(args: argparse.Namespace) -> int:
    world = Topology(tp=args.tp, cp=args.cp).world_size
    sockets = [args.socket.format(rank=rank) for rank in range(world)]
    work = Path(args.work_dir)
    private_run_dir(work)
    try:
        waited = await wait_serving(sockets, args.serving_timeout_s)
    except errors.CacheError as exc:
        emit({"phase": "serving", "passed": False, "message": str(exc)})
        return 2
    emit({"phase": "serving", "passed": True, "ranks": world, "waited_s": round(waited, 1)})
    report, last_step = await replay_phase(args, sockets, work)
    emit({"phase": "replay", **report})
    if not report["passed"] or args.no_kill_check:
        return 0 if report["passed"] else 1
    result = await kill_phase(args, sockets, work, last_step)
    emit(result)
    return 0 if result["passed"] else 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cpcache.testing.compose_driver", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="a Mooncake-format trace (JSON lines)")
    p.add_argument("--requests", type=int, default=200, help="how many requests to replay")
    p.add_argument("--skip", type=int, default=0, help="start this many requests into the trace")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--socket", default="/run/cpcache/rank-{rank}.sock", help="each rank's socket ({rank} expands)")
    p.add_argument("--work-dir", default="/run/cpcache/driver",
                   help="private directory on the daemons' volume: device pools, the kill FIFO")
    p.add_argument("--storage", default=os.environ.get("CPCACHE_STORAGE", "file"), help="for the report only")
    p.add_argument("--device-pages", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4, help="requests per step")
    p.add_argument("--serving-timeout-s", type=float, default=300.0, help="longest wait for every rank to serve")
    p.add_argument("--kill-wait-s", type=float, default=300.0, help="longest wait for the kill notice")
    p.add_argument("--unavailable-within-s", type=float, default=30.0,
                   help="deadline of each survivor's step after the kill")
    p.add_argument("--no-kill-check", action="store_true", help="stop after the replay")
    return p


def run() -> None:
    args = parser().parse_args()
    if not Path(args.trace).is_file():
        raise SystemExit(f"compose driver: trace {args.trace} not found (mount the repository's traces/ at /traces)")
    sys.exit(asyncio.run(main(args)))


if __name__ == "__main__":
    run()
