"""`cpcache bench late-prefetches`: how often a `best_effort` prefetch ends
before its pages are read, with `prefetch_best_effort_wait_s` at 0 (it ends
when polled: the old behaviour) and at its default, in the same run.

Two domains of 2 real daemons each (real gloo, real gRPC, file storage with
every storage call slowed by uniform(0, `--storage-delay-ms`) ms on each
rank, as a store on the network would be), one per setting, alternated in
blocks. Each prefetch asks for a chain of PAGES pages that storage holds,
and is polled in the step after its hit is agreed, as SGLang's scheduler
polls one whose request comes up at once. Counted per setting: prefetches
that ended short (`prefetches_short`), their pages read and thrown away
(`lost_hit_pages_prefetch_late`, rank 0's), the pages accepted, and the
steps and milliseconds from the poll to the end (what the wait costs the
request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from cpcache.client import AsyncClient, CacheRequests, PrefetchRequest, StepResult
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.dataplane.pools import DevicePool
from cpcache.dataplane.storage import PageBuffer, open_backend
from cpcache.geometry import KVGeometry
from cpcache.keys import ShardingSpec, chain, tenant_of
from cpcache.testing.sim.pages import page_content
from cpcache.topology import Topology

GEOMETRY = KVGeometry(layers=2, kv_kind="mha", heads=1, head_dim=16, dtype="bfloat16", page_size=16)
PAGES = 8  # per prefetch
PREFETCHES = 30  # per setting per block
WAITS = {"ends when polled (wait 0)": 0.0, "default wait (0.05 s)": 0.05}
MODEL = "bench-model"


def _store(root: Path, hashes: list[str]) -> None:
    """Both ranks' copies of the pages, as the daemons key them."""
    for rank in range(2):
        backend = open_backend("file", root=str(root), geometry_fingerprint=GEOMETRY.fingerprint())
        sharding = ShardingSpec(tp_rank=rank, tp_size=2, tenant=tenant_of(MODEL, GEOMETRY.fingerprint()))
        keys = [sharding.storage_key(h) for h in hashes]
        assert backend.put_from(keys, [PageBuffer(0, page_content(k, GEOMETRY.page_bytes)) for k in keys]) \
            == [True] * len(keys)
        backend.close()


class Domain:
    """Two daemons with one `prefetch_best_effort_wait_s`, and a scheduler stepping both."""

    def __init__(self, run_dir: Path, wait_s: float, delay_ms: float) -> None:
        self.root = run_dir / "pages"
        self.spec = DomainSpec(Topology(tp=2), run_dir, extra=dict(
            storage="file", storage_root=str(self.root), host_pool_pages=256, prefetch_policy="best_effort",
            prefetch_best_effort_wait_s=wait_s, fault_storage_delay_ms=delay_ms))
        self.step = 0
        self.op = 0
        self.ended: list[tuple[int, int, int, float]] = []  # (hit, done, steps from poll, ms from poll)

    async def start(self) -> None:
        self.domain = await LocalDomain(self.spec).__aenter__()
        self.clients = [AsyncClient(s) for s in self.domain.sockets]
        self.pools = [DevicePool.create_sealed(GEOMETRY, 16) for _ in self.clients]
        replies = await asyncio.gather(*(c.attach(MODEL, GEOMETRY, 16, pool_fd=p.fd)
                                         for c, p in zip(self.clients, self.pools)))
        self.seed = replies[0].key_seed

    async def stop(self) -> None:
        for c in self.clients:
            await c.close()
        await self.domain.__aexit__(None, None, None)

    async def _step(self, requests: CacheRequests | None = None) -> StepResult:
        self.step += 1
        replies = await asyncio.gather(*(c.step(self.step, requests=requests) for c in self.clients))
        return replies[0]

    async def prefetch(self) -> None:
        self.op += 1
        pages = chain([self.op % 500 + 1, self.step % 500 + 1] * (PAGES * GEOMETRY.page_size // 2),
                      GEOMETRY.page_size, self.seed)
        _store(self.root, pages)
        reply = await self._step(CacheRequests(prefetches=(PrefetchRequest(
            self.op, tuple(bytes.fromhex(h) for h in pages), PAGES * GEOMETRY.page_size),)))
        while self.op not in reply.prefetch_hits:
            reply = await self._step()
        hit, polled, began = reply.prefetch_hits[self.op], self.step, time.perf_counter()
        while self.op not in reply.prefetch_done:
            reply = await self._step(CacheRequests(prefetch_polls=(self.op,)))
        self.ended.append((hit, reply.prefetch_done[self.op], self.step - polled,
                           (time.perf_counter() - began) * 1e3))

    async def counters(self) -> dict[str, int]:
        stats = await self.clients[0].stats()
        return {k: stats[k] for k in ("prefetches_short", "lost_hit_pages_prefetch_late", "storage_hit_pages")}


async def run(blocks: int, delay_ms: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="cpc-late-") as tmp:
        domains = {name: Domain(Path(tmp) / f"d{i}", wait, delay_ms) for i, (name, wait) in enumerate(WAITS.items())}
        for d in domains.values():
            await d.start()
        try:
            for _ in range(blocks):
                for d in domains.values():
                    for _ in range(PREFETCHES):
                        await d.prefetch()
            rows = {}
            for name, d in domains.items():
                counts = await d.counters()
                rows[name] = {"prefetches": len(d.ended), **counts,
                              "pages_hit": sum(h for h, *_ in d.ended),
                              "pages_accepted": sum(n for _, n, *_ in d.ended),
                              "steps_from_poll_median": statistics.median(s for *_, s, _ in d.ended),
                              "ms_from_poll_median": round(statistics.median(ms for *_, ms in d.ended), 2),
                              "ms_from_poll_p90": round(sorted(ms for *_, ms in d.ended)[int(0.9 * len(d.ended))], 2)}
        finally:
            for d in domains.values():
                await d.stop()
    return {"blocks": blocks, "prefetches_per_block": PREFETCHES, "pages_per_prefetch": PAGES,
            "storage_delay_ms": delay_ms, "settings": rows}


async def main(args: argparse.Namespace) -> int:
    report = await run(getattr(args, "repeat", 2), getattr(args, "storage_delay_ms", 20.0))
    if args.json:
        print(json.dumps(report))
    else:
        print("| setting | prefetches | ended short | pages thrown away | pages accepted | poll to end, median ms |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, r in report["settings"].items():
            print(f"| {name} | {r['prefetches']} | {r['prefetches_short']} | {r['lost_hit_pages_prefetch_late']} | "
                  f"{r['pages_accepted']} / {r['pages_hit']} | {r['ms_from_poll_median']} |")
    return 0
