"""Replay a trace on every rank of a local deployment and report what happened.

One `SimScheduler` per rank, each with its own client and its own device
pool (a shared-memory file its daemon maps). Requests arrive by timestamp:
a step covers `step_ms` of trace time scaled by `time_scale`; with
`time_scale = 0` every step takes `batch` requests, as fast as possible.

With attention DP (`dp > 1`) the world holds one agreement domain per DP
replica, and each request goes to one replica only: see `route`. A rank's
scheduler sees only its own replica's requests; agreement (each step's reply,
byte for byte) and decision logs are compared among the ranks of one domain,
never across domains, which legitimately hold different state. The report
gives each domain's figures under "domains" and their totals at top level.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from cpcache.client import AsyncClient, StepResult, Tally
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.dataplane.pools import DevicePool
from cpcache.errors import CacheError
from cpcache.geometry import KVGeometry
from cpcache.keys import ShardingSpec
from cpcache.testing.mooncake_master import MooncakeMaster
from cpcache.testing.sim.breakdown import step_breakdown
from cpcache.testing.sim.scheduler import SimScheduler, Workload
from cpcache.testing.sim.trace import PageHasher, Request, ceiling_hit_rate, load
from cpcache.testing.stats import percentiles_us
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
    # A restart at `restart_at` of the arrivals: "schedulers" (every scheduler
    # process dies and starts again, attaching anew), "daemon-kill" (rank
    # `restart_rank`'s daemon is SIGKILLed and the launcher starts it again),
    # "daemon-stop" (it is SIGSTOPped past the agreement timeout, then
    # continued). The report's "halves" split the hit rates at that point
    # whether or not anything restarts, so runs compare.
    restart: str = "none"
    restart_at: float = 0.5
    restart_rank: int = 1
    agreement_timeout_s: float = 10.0




def arrivals(requests: list[Request], cfg: ReplayConfig) -> Iterator[list[Request]]:
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


def route(request: Request, replicas: int) -> int:
    """The attention-DP replica (index into `Topology.domains()`, which is the
    DP rank) that serves a request: SGLang's default DP-attention load
    balancing, round robin, by the request's position in its trace
    (`request.index`, its line number). Deterministic, so every rank agrees on
    it without talking, and a request keeps its replica on every pass."""
    return request.index % replicas


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
                         storage_segment_bytes=256 << 20)
        spec = DomainSpec(cfg.topology, run_dir, mode=cfg.mode, agreement_lag=cfg.lag,
                          agreement_timeout_s=cfg.agreement_timeout_s, fault_delay_ms=cfg.fault_delay_ms,
                          seed=cfg.seed, extra=extra)
        async with LocalDomain(spec) as domain:
            return await _drive(cfg, domain, requests, run_dir, progress)


@dataclass
class _Domain:
    """One agreement domain of the replay: its ranks' schedulers, the
    requests routed to it and its own tallies of divergent steps."""

    index: int
    dp: int
    ranks: tuple[int, ...]
    schedulers: list[SimScheduler]
    requests: list[Request] = field(default_factory=list)
    divergences: int = 0
    past: list[list[SimScheduler]] = field(default_factory=list)  # the schedulers of earlier lives
    outage_lives: set[int] = field(default_factory=set)  # indexes into `past`: lives that ended in a lost daemon

    def lives(self) -> list[tuple[list[SimScheduler], bool]]:
        """Each life's schedulers, and whether it ended in a lost daemon."""
        return [*((life, i in self.outage_lives) for i, life in enumerate(self.past)), (self.schedulers, False)]

    @property
    def workload(self) -> Workload:
        # Every rank of a domain sees the same requests and replies: rank 0's counts are the domain's.
        return merged([self.schedulers[0].workload, *(life[0].workload for life in self.past)])

    @property
    def cache(self) -> Tally:
        return merged([self.schedulers[0].session.tally, *(life[0].session.tally for life in self.past)])

    @property
    def every_scheduler(self) -> list[SimScheduler]:
        return [*self.schedulers, *(s for life in self.past for s in life)]


Counts = TypeVar("Counts", Workload, Tally)


def merged(counts: list[Counts]) -> Counts:
    out = type(counts[0])()
    for c in counts:
        for name in out.__dataclass_fields__:
            setattr(out, name, getattr(out, name) + getattr(c, name))
    return out


async def _drive(cfg: ReplayConfig, domain: LocalDomain, requests: list[Request], run_dir: Path,
                 progress: Callable[[dict], None] | None) -> dict:
    topology = cfg.topology
    schedulers = await _start_schedulers(cfg, domain, run_dir, life=1)
    domains = [
        _Domain(i, topology.coordinates(group.ranks[0]).dp, group.ranks, [schedulers[r] for r in group.ranks])
        for i, group in enumerate(topology.domains())
    ]
    for request in requests:
        domains[route(request, len(domains))].requests.append(request)
    latencies: list[float] = []
    hit_series: list[float] = []
    steps = 0
    started = time.monotonic()
    halfway: Workload | None = None
    restart: dict = {"kind": cfg.restart}

    def total_tally() -> Workload:
        return merged([d.workload for d in domains])

    async def restart_schedulers(life: int) -> list[Request]:
        """Every scheduler process dies and starts again: new clients, new
        pools, a new attach (a new session on every rank). The requests they
        had in flight are lost with them; the server runs them again."""
        nonlocal schedulers
        lost = [a.request for d in domains for a in d.schedulers[0].active]
        restart["requests_run_again"] = restart.get("requests_run_again", 0) + len(lost)
        for s in schedulers:
            await s.client.close()
        fresh = await _start_schedulers(cfg, domain, run_dir, life)
        for d in domains:
            d.past.append(d.schedulers)
            d.schedulers = [fresh[r] for r in d.ranks]
        schedulers = fresh
        restart["resumed_pages"] = fresh[0].resumed_pages
        return lost

    async def one_step(batch: list[Request]) -> None:
        nonlocal steps
        routed: list[list[Request]] = [[] for _ in domains]
        for request in batch:
            routed[route(request, len(domains))].append(request)
        t0 = time.perf_counter()
        replies = await asyncio.gather(
            *(s.iterate(routed[d.index]) for d in domains for s in d.schedulers), return_exceptions=True
        )
        latencies.append(time.perf_counter() - t0)
        steps += 1
        results: list[StepResult] = []
        for outcome in replies:
            if isinstance(outcome, BaseException):  # the first failure, cancellation included
                raise outcome
            results.append(outcome)
        at = 0
        for d in domains:  # replies come back in the order they were asked for
            mine = results[at : at + len(d.schedulers)]
            at += len(d.schedulers)
            d.divergences += len({r.wire for r in mine}) > 1
        hit_series.append(total_tally().hit_rates()["total"])

    def summary() -> dict:
        return {"requests": total_tally().requests, "of": len(requests), "steps": steps,
                "divergences": sum(d.divergences for d in domains),
                "hit_rate": total_tally().hit_rates()["total"], "elapsed_s": time.monotonic() - started}

    batches = list(arrivals(requests, cfg))
    split = int(len(batches) * cfg.restart_at)
    for i, batch in enumerate(batches):
        if i == split:
            halfway = copy.deepcopy(total_tally())
            if cfg.restart == "schedulers":
                batch = await restart_schedulers(2) + batch
            elif cfg.restart in ("daemon-kill", "daemon-stop"):
                batch = await _daemon_outage(cfg, domain, one_step, batch, restart_schedulers, restart)
                for d in domains:
                    d.outage_lives.add(len(d.past) - 1)
        await one_step(batch)
        if progress and (i % max(1, len(batches) // 20) == 0 or i == len(batches) - 1):
            progress(summary())
    for _ in range(cfg.drain_steps):
        if not any(s.active or s.session.has_unsent() for s in schedulers):
            break
        await one_step([])
    for _ in range(max(3, cfg.lag + 2)):  # let the last writes be acknowledged
        await one_step([])
    statuses = [await s.client.status() for s in schedulers]
    stats = [await s.client.stats() for s in schedulers]
    for s in schedulers:
        await s.client.close()

    def moved(rank: int) -> dict[str, int]:
        return {k.replace("pages_moved_", "").replace("_to_", "->"): v for k, v in stats[rank].items()
                if k.startswith("pages_moved_")}

    per_domain = []
    for d in domains:
        tally, cache = d.workload, d.cache
        per_domain.append({
            "domain": d.index,
            "dp": d.dp,
            "ranks": list(d.ranks),
            "requests": tally.requests,
            "decisions": stats[d.ranks[0]].get("decisions", 0),
            "divergences": d.divergences,
            # Only a life that ended in a lost daemon may lack replies (see `agreeing_logs`).
            "identical_decision_logs": all(agreeing_logs([s.log.entries for s in life],
                                                         cfg.lag if outage else 0)[0]
                                           for life, outage in d.lives()),
            "replies_lost_with_a_daemon": sum(agreeing_logs([s.log.entries for s in life], cfg.lag)[1]
                                              for life, outage in d.lives() if outage),
            "corrupt_loads": sum(s.workload.corrupt_loads for s in d.every_scheduler),
            "loaded_pages": sum(s.workload.loaded_pages for s in d.every_scheduler),
            "hit_rate": {k: round(v, 4) for k, v in tally.hit_rates().items()},
            # An infinite cache that saw only this domain's requests. Storage is
            # shared by every domain, so a domain may beat it with pages another wrote.
            "hit_rate_ceiling": round(ceiling_hit_rate(d.requests, GEOMETRY.page_size), 4),
            "prefetches": cache.prefetches,
            "prefetch_revoked": cache.prefetch_revoked,
            "pages_moved": moved(d.ranks[0]),
        })
    tally, cache = total_tally(), merged([d.cache for d in domains])
    return {
        "ranks": topology.world_size,
        "topology": topology.describe(),
        "mode": cfg.mode,
        "lag": cfg.lag,
        "storage": cfg.storage,
        "routing": "round robin by trace position (request index mod dp)",
        "requests": tally.requests,
        "steps": steps,
        "decisions": sum(d["decisions"] for d in per_domain),
        "divergences": sum(d["divergences"] for d in per_domain),
        "identical_decision_logs": all(d["identical_decision_logs"] for d in per_domain),
        "replies_lost_with_a_daemon": sum(d["replies_lost_with_a_daemon"] for d in per_domain),
        "corrupt_loads": sum(d["corrupt_loads"] for d in per_domain),
        "loaded_pages": sum(d["loaded_pages"] for d in per_domain),
        "hit_rate": {k: round(v, 4) for k, v in tally.hit_rates().items()},
        # An infinite cache shared by every domain (one storage tier is).
        "hit_rate_ceiling": round(ceiling_hit_rate(requests, GEOMETRY.page_size), 4),
        "prefetches": cache.prefetches,
        "prefetch_revoked": cache.prefetch_revoked,
        "pages_moved_rank0": moved(0),
        "epoch": statuses[0].epoch,
        "halves": _halves(halfway, tally),
        "restart": restart,
        "round_latency_us": percentiles_us([t for d in domains for s in d.every_scheduler for t in s.round_latencies]),
        "round_latency_mean_ms": _mean_ms([t for d in domains for s in d.every_scheduler for t in s.round_latencies]),
        "step_phases": step_breakdown(stats),
        "step_latency_us": percentiles_us(latencies),
        "wall_s": round(time.monotonic() - started, 1),
        "domains": per_domain,
        "per_step_latency_s": latencies,
        "per_step_hit_rate": hit_series,
    }


async def _start_schedulers(cfg: ReplayConfig, domain: LocalDomain, run_dir: Path, life: int) -> list[SimScheduler]:
    """One scheduler per rank, each with a new device pool, attached at once
    on every rank (Attach is agreed)."""
    topology = cfg.topology
    clients = [AsyncClient(socket) for socket in domain.sockets]
    pools = [DevicePool.create_sealed(GEOMETRY, cfg.device_pages, name=f"rank{rank}-life{life}")
             for rank in range(len(clients))]
    replies = await asyncio.gather(*(client.attach("trace-replay", GEOMETRY, cfg.device_pages, pool_fd=pool.fd)
                                     for client, pool in zip(clients, pools)))
    schedulers: list[SimScheduler] = []
    for rank, (client, pool, reply) in enumerate(zip(clients, pools, replies)):
        coords = topology.coordinates(rank)
        sharding = ShardingSpec(cp_rank=coords.cp, cp_size=topology.cp, tp_rank=coords.atp, tp_size=topology.atp)
        scheduler = SimScheduler(client, pool, PageHasher(reply.key_seed, GEOMETRY.page_size), sharding,
                                 cfg.device_pages)
        scheduler.resumed_pages = reply.resumed_pages
        schedulers.append(scheduler)
    return schedulers


async def _daemon_outage(cfg: ReplayConfig, domain: LocalDomain, one_step: Callable[[list[Request]], Awaitable[None]],
                         batch: list[Request], restart_schedulers: Callable[[int], Awaitable[list[Request]]],
                         restart: dict) -> list[Request]:
    """Take rank `restart_rank`'s daemon away (SIGKILL, or SIGSTOP past the
    agreement timeout), keep stepping as a scheduler would until the domain
    answers again, then attach anew. The launcher restarts a killed daemon,
    as systemd would; nobody touches the others. Returns the requests to
    run next."""
    rank = cfg.restart_rank
    started, failed_steps = time.monotonic(), 0
    supervisor = None
    if cfg.restart == "daemon-kill":
        domain.signal(rank, signal.SIGKILL)
        supervisor = asyncio.ensure_future(domain.restart(rank, timeout_s=120.0))
    else:
        domain.signal(rank, signal.SIGSTOP)
    step = asyncio.ensure_future(one_step([]))  # the schedulers go on stepping into the outage
    if cfg.restart == "daemon-stop":
        await asyncio.sleep(cfg.agreement_timeout_s + 1.0)  # the outage itself: stopped past the timeout
        domain.signal(rank, signal.SIGCONT)
    try:
        await step
    except CacheError as exc:
        failed_steps += 1
        restart["first_error"] = str(exc)[:300]
    if supervisor is not None:
        await supervisor
    for socket in domain.sockets:
        async with AsyncClient(socket) as client:
            await client.wait_serving(120.0)
    lost = await restart_schedulers(2)
    restart.update(rank=rank, outage_s=round(time.monotonic() - started, 2), outage_steps=failed_steps)
    return lost + batch


def agreeing_logs(logs: list[list[bytes]], lag: int) -> tuple[bool, int]:
    """Whether the decision logs of one domain's schedulers (one life of
    them) agree, and how many replies the shorter ones lack. At lag >= 1 a
    step answers with a round completed a step earlier: a daemon that dies
    between two steps takes up to `lag` such replies with it, which its
    peers' schedulers did get (and a peer still exchanging the latest round
    with it fails that round that others completed). So the logs agree when
    each is a prefix of the longest, short of it by at most `lag` replies
    (none at lag 0)."""
    longest = max(logs, key=len, default=[])
    lost = [len(longest) - len(log) for log in logs]
    agree = all(log == longest[: len(log)] for log in logs) and max(lost, default=0) <= lag
    return agree, sum(lost)


def _mean_ms(seconds: list[float]) -> float:
    return round(1000 * sum(seconds) / len(seconds), 3) if seconds else 0.0


def _halves(halfway: Workload | None, total: Workload) -> dict:
    """Hit rates before and after the split point (the restart, if any)."""
    if halfway is None:
        return {}
    second = Workload()
    for name in Workload.__dataclass_fields__:
        setattr(second, name, getattr(total, name) - getattr(halfway, name))
    return {"first": {k: round(v, 4) for k, v in halfway.hit_rates().items()},
            "second": {k: round(v, 4) for k, v in second.hit_rates().items()}}
