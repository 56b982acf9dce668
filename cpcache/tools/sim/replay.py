"""Replay a trace on every rank of a local domain and report what happened.

One `SimScheduler` per rank, each with its own client and its own device
pool (a shared-memory file its daemon maps). Requests arrive by timestamp:
a step covers `step_ms` of trace time scaled by `time_scale`; with
`time_scale = 0` every step takes `batch` requests, as fast as possible.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from cpcache.tools.bench.stats import percentiles_us
from cpcache.client import AsyncClient
from cpcache.geometry import KVGeometry
from cpcache.keys import ShardingSpec
from cpcache.tools.launcher import DomainSpec, LocalDomain
from cpcache.tools.sim.scheduler import SimScheduler
from cpcache.tools.sim.trace import PageHasher, Request, ceiling_hit_rate, load
from cpcache.tools.mooncake_master import MooncakeMaster
from cpcache.dataplane.pools import DevicePool
from cpcache.topology import Topology

GEOMETRY = KVGeometry(layers=2, kv_kind="mha", heads=1, head_dim=16, dtype="bfloat16", page_size=256)


@dataclass
class ReplayConfig:
    trace: Path
    requests: int = 200
    skip: int = 0
    topology: Topology = field(default_factory=lambda: Topology(tp=4, cp=2))
    storage: str = "file"
    mode: str = "domain"
    lag: int = 0
    device_pages: int = 1024
    host_pages: int = 4096
    batch: int = 4
    time_scale: float = 0.0  # 0: as fast as possible
    step_ms: float = 1000.0
    prefetch_policy: str = "best_effort"
    write_policy: str = "write_through"
    fault_delay_ms: float = 0.0
    fault_fail_rate: float = 0.0
    seed: int = 0
    passes: int = 1  # replay the slice this many times (later passes find it in storage)
    drain_steps: int = 200  # steps after the last arrival to let operations close
    run_dir: Path | None = None


def arrivals(requests: list[Request], cfg: ReplayConfig):
    """Yield the requests of each step."""
    if cfg.time_scale <= 0:
        for i in range(0, len(requests), cfg.batch):
            yield requests[i : i + cfg.batch]
        return
    window = cfg.step_ms * cfg.time_scale
    start = requests[0].timestamp_ms if requests else 0
    i, step = 0, 1
    while i < len(requests):
        limit = start + step * window
        j = i
        while j < len(requests) and requests[j].timestamp_ms < limit:
            j += 1
        yield requests[i:j]
        i, step = j, step + 1


async def replay(cfg: ReplayConfig, progress: Callable[[dict], None] | None = None) -> dict:
    requests = load(cfg.trace, cfg.requests, cfg.skip) * cfg.passes
    with contextlib.ExitStack() as stack:
        run_dir = cfg.run_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cpc-replay-")))
        extra = dict(
            host_pool_pages=cfg.host_pages, storage=cfg.storage, storage_root=str(run_dir / "pages"),
            prefetch_policy=cfg.prefetch_policy, write_policy=cfg.write_policy, io_threads=2,
            fault_storage_delay_ms=cfg.fault_delay_ms, fault_storage_fail_rate=cfg.fault_fail_rate,
            prefetch_threshold_tokens=GEOMETRY.page_size,
        )
        if cfg.storage == "mooncake":
            master = stack.enter_context(MooncakeMaster(run_dir / "mooncake-master.log"))
            extra.update(storage_master=master.master, storage_metadata_server=master.metadata_server,
                         storage_segment_bytes=64 << 20)
        spec = DomainSpec(cfg.topology, run_dir, mode=cfg.mode, agreement_lag=cfg.lag,
                          fault_delay_ms=cfg.fault_delay_ms, seed=cfg.seed, extra=extra)
        async with LocalDomain(spec) as domain:
            return await _drive(cfg, domain, requests, run_dir, progress)


async def _drive(cfg, domain: LocalDomain, requests, run_dir: Path, progress) -> dict:
    topology = cfg.topology
    schedulers: list[SimScheduler] = []
    for rank, socket in enumerate(domain.sockets):
        client = AsyncClient(socket)
        pool_path = str(run_dir / f"device-{rank}.pool")
        pool = DevicePool.create_shared_file(pool_path, GEOMETRY, cfg.device_pages)
        reply = await client.attach("trace-replay", GEOMETRY, cfg.device_pages, shm_path=pool_path)
        coords = topology.coordinates(rank)
        suffix = ShardingSpec(cp_rank=coords.cp, cp_size=topology.cp, tp_rank=coords.atp,
                              tp_size=topology.atp).suffix()
        schedulers.append(SimScheduler(client, pool, PageHasher(reply.key_seed, GEOMETRY.page_size), suffix,
                                       cfg.device_pages))
    latencies: list[float] = []
    hit_series: list[float] = []
    divergences = steps = 0
    started = time.monotonic()

    async def one_step(batch) -> None:
        nonlocal divergences, steps
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(s.iterate(batch) for s in schedulers), return_exceptions=True)
        latencies.append(time.perf_counter() - t0)
        steps += 1
        failures = [r for r in replies if isinstance(r, Exception)]
        if failures:
            raise failures[0]
        divergences += len({r.wire for r in replies}) > 1
        hit_series.append(schedulers[0].tally.hit_rates()["total"])

    batches = list(arrivals(requests, cfg))
    for i, batch in enumerate(batches):
        await one_step(batch)
        if progress and (i % max(1, len(batches) // 20) == 0 or i == len(batches) - 1):
            progress(_summary(schedulers, steps, divergences, len(requests), started))
    for _ in range(cfg.drain_steps):
        if not any(s.active or s.pending.loads or s.pending.writes for s in schedulers):
            break
        await one_step([])
    for _ in range(max(3, cfg.lag + 2)):  # let the last writes be acknowledged
        await one_step([])
    stats = [await s.client.stats() for s in schedulers]
    for s in schedulers:
        await s.client.close()
    tally = schedulers[0].tally
    moved = {k.replace("pages_moved_", "").replace("_to_", "->"): v for k, v in stats[0].items()
             if k.startswith("pages_moved_")}
    return {
        "ranks": topology.world_size,
        "topology": topology.describe(),
        "mode": cfg.mode,
        "lag": cfg.lag,
        "storage": cfg.storage,
        "requests": tally.requests,
        "steps": steps,
        "decisions": stats[0].get("decisions", 0),
        "divergences": divergences,
        "identical_decision_logs": all(s.log == schedulers[0].log for s in schedulers),
        "corrupt_loads": sum(s.tally.corrupt_loads for s in schedulers),
        "loaded_pages": sum(s.tally.loaded_pages for s in schedulers),
        "hit_rate": {k: round(v, 4) for k, v in tally.hit_rates().items()},
        "hit_rate_ceiling": round(ceiling_hit_rate(requests, GEOMETRY.page_size), 4),
        "prefetches": tally.prefetches,
        "prefetch_revoked": tally.prefetch_revoked,
        "pages_moved_rank0": moved,
        "round_latency_us": percentiles_us([t for s in schedulers for t in s.round_latencies]),
        "step_latency_us": percentiles_us(latencies),
        "wall_s": round(time.monotonic() - started, 1),
        "per_step_latency_s": latencies,
        "per_step_hit_rate": hit_series,
    }


def _summary(schedulers, steps, divergences, total, started) -> dict:
    tally = schedulers[0].tally
    return {"requests": tally.requests, "of": total, "steps": steps, "divergences": divergences,
            "hit_rate": tally.hit_rates()["total"], "elapsed_s": time.monotonic() - started}
