"""One fuzz run: a fresh two-rank domain (file storage, a small host pool),
local RPCs (Attach, WaitLoads, Match, Stats, Status) sent to one rank,
CONCURRENCY at a time, while the decision rounds run; then the daemons must
still serve and answer a last valid step alike."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from cpcache.client import AsyncClient
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.dataplane.pools import DevicePool
from cpcache.testing.fuzz.decisions import DecisionRounds
from cpcache.testing.fuzz.generate import Gen
from cpcache.testing.fuzz.report import Report, print_report
from cpcache.testing.fuzz.wire import (
    AGREEMENT_TIMEOUT_S,
    CONCURRENCY,
    DEADLINE_S,
    DEVICE_PAGES,
    GEOMETRY,
    HOST_PAGES,
    LOCALS,
    MAX_STEP,
    RankChannel,
    parse,
    short,
)
from cpcache.topology import Topology
from cpcache.v1 import daemon_pb2 as pb


class Fuzz:
    """One run against a started domain: `per_rpc` requests of every RPC."""

    def __init__(self, domain: LocalDomain, run_dir: Path, per_rpc: int, seed: int) -> None:
        self.domain = domain
        self.per_rpc = per_rpc
        self.report = Report(per_rpc, seed)
        self.local_gen = Gen(random.Random(seed + 2), run_dir)
        self.ranks = [RankChannel(s) for s in domain.sockets]
        self.clients = [AsyncClient(s, timeout_s=DEADLINE_S) for s in domain.sockets]
        self.decisions = DecisionRounds(self.ranks, self.clients, self.report, seed,
                                   Gen(random.Random(seed + 1), run_dir), self.local_gen)
        self.pools: list[DevicePool] = []  # the valid attach's device pools, held for the run

    # -- local RPCs

    async def local_one(self, rpc: str, rank: int, data: bytes, raw: bool, request: Message | None = None) -> None:
        outcome = await self.ranks[rank].call(rpc, data)
        self.report.count(rpc, outcome, raw)
        if raw and parse(rpc, data) is None:
            self.report.check_undecodable(rpc, outcome, data)
            return
        # A WaitLoads whose own timeout outlasts our deadline may pass it.
        long_wait = rpc == "WaitLoads" and request is not None and not (request.timeout_s < DEADLINE_S - 2)
        self.report.check_status(rpc, outcome, data, deadline_ok=long_wait)
        if rpc == "Attach" and outcome.ok:
            self.report.violation("hostile attach accepted", rpc, "OK", data)
        if rpc == "Status" and outcome.ok:
            state = pb.StatusReply.FromString(outcome.reply).state
            if state != "serving":
                self.report.violation("not serving", rpc, f"state {state!r}", data)

    def local_request(self, rpc: str) -> tuple[bytes, bool, object]:
        gen = self.local_gen
        request = gen.local(rpc)
        data = request.SerializeToString()
        if gen.r.random() < 0.2:
            return gen.raw(data), True, None
        return data, False, request

    async def local_batch(self, rpcs: list[str]) -> None:
        jobs = []
        for rpc in rpcs:
            data, raw, request = self.local_request(rpc)
            jobs.append(self.local_one(rpc, self.local_gen.r.randrange(len(self.ranks)), data, raw, request))
        await asyncio.gather(*jobs)

    # -- whole run

    async def attach_valid(self) -> None:
        self.pools = [DevicePool.create_sealed(GEOMETRY, DEVICE_PAGES) for _ in self.clients]
        # Attach is agreed across the domain: every rank at once.
        await asyncio.gather(*(c.attach("fuzz-model", GEOMETRY, DEVICE_PAGES, pool_fd=p.fd)
                               for c, p in zip(self.clients, self.pools)))

    async def finish(self) -> None:
        """The daemons still serve; a valid step, then the last one there is, answered alike."""
        for rank, client in enumerate(self.clients):
            status = await client.status()
            if status.state != "serving" or status.failure:
                self.report.violation("not serving at the end", "Status", f"rank {rank}: {status}")
            health = await client.health()
            if health != health_pb2.HealthCheckResponse.SERVING:
                self.report.violation("not healthy at the end", "Health", f"rank {rank}: {health}")
        for step in (self.decisions.step + 1, MAX_STEP):
            request = pb.StepRequest(step=step)
            request.votes.op_ids.append(self.decisions.gen.fresh_id())
            request.votes.reduces.append(pb.REDUCE_MIN)
            request.votes.values.append(5)
            data = request.SerializeToString()
            outcomes = await asyncio.gather(*(rank.call("Step", data) for rank in self.ranks))
            if not all(o.ok for o in outcomes) or len({o.reply for o in outcomes}) != 1:
                self.report.violation("final valid step failed", "Step",
                                      "; ".join(f"{o.code} {short(o.message)}" for o in outcomes), data)
            self.decisions.step = step
        digests = await self.decisions.digests()
        if len(set(digests)) != 1:
            self.report.violation("digests differ at the end", "Stats", str(digests))

    async def run(self, run_dir: Path) -> Report:
        attach_dir = run_dir / "attach"
        attach_dir.mkdir()
        (attach_dir / "dir").mkdir()
        (attach_dir / "empty").touch()
        # Attach while nothing is attached (half), then everything else while the rounds run.
        await self._locals({"Attach": self.per_rpc // 2})
        await self.attach_valid()
        quotas = {rpc: self.per_rpc - (self.per_rpc // 2 if rpc == "Attach" else 0) for rpc in LOCALS}
        local = asyncio.ensure_future(self._locals(quotas))
        try:
            await self.decisions.run(self.per_rpc)
        finally:
            await local
        await self.finish()
        return self.report

    async def _locals(self, quotas: dict[str, int]) -> None:
        """Send `quotas[rpc]` requests of each RPC, CONCURRENCY at a time."""
        left = dict(quotas)
        while any(left.values()):
            batch: list[Any] = []
            while len(batch) < CONCURRENCY and any(left.values()):
                rpc = self.local_gen.r.choice([r for r, n in left.items() if n])
                left[rpc] -= 1
                batch.append(rpc)
            await self.local_batch(batch)

    async def close(self) -> None:
        for rank in self.ranks:
            await rank.close()
        for client in self.clients:
            await client.close()


async def fuzz(per_rpc: int, seed: int, run_dir: Path | None = None) -> Report:
    """One fuzz run against a fresh two-rank domain; returns its report."""
    started = time.monotonic()
    own = run_dir is None
    run_dir = Path(tempfile.mkdtemp(prefix="cpf-")) if run_dir is None else run_dir
    try:
        spec = DomainSpec(Topology(tp=2), run_dir, agreement_timeout_s=AGREEMENT_TIMEOUT_S,
                          extra=dict(storage="file", storage_root=str(run_dir / "pages"), host_pool_pages=HOST_PAGES,
                                     prefetch_threshold_tokens=0))
        async with LocalDomain(spec) as domain:
            session = Fuzz(domain, run_dir, per_rpc, seed)
            try:
                report = await session.run(run_dir)
            except Exception as exc:
                report = session.report
                report.violation("fuzz aborted", "-", f"{type(exc).__name__}: {short(exc)}\n"
                                 + "\n".join(domain.log_tail(r, 15) for r in range(domain.size)))
            finally:
                await session.close()
            codes = await domain.stop()
            if any(code != 0 for code in codes):
                report.violation("unclean exit", "-", f"exit codes {codes}\n"
                                 + "\n".join(domain.log_tail(r, 15) for r in range(domain.size)))
    finally:
        if own:
            shutil.rmtree(run_dir, ignore_errors=True)
    report.wall_s = time.monotonic() - started
    return report


async def main(args: argparse.Namespace) -> int:
    report = await fuzz(args.per_rpc, args.seed)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        print_report(report)
    sys.stdout.flush()
    return 0 if not report.violations else 1
