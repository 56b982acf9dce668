"""The CacheDaemon servicer: a thin translation between protobuf messages and
the core. Validation and decisions live in the core."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import grpc

from cpcache.agreement.rounds import Questions
from cpcache.daemon.status import Undecodable, guarded, wire_status
from cpcache.daemon.wire import (
    Attached,
    DaemonStatus,
    attach_reply,
    ops_from_wire,
    prefetches_from_wire,
    request_digest,
    status_reply,
    step_reply,
    votes_from_wire,
)
from cpcache.errors import CacheError, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, Unavailable
from cpcache.geometry import KVGeometry
from cpcache.rank.assembly import CacheRuntime
from cpcache.rank.stepper import Stepper
from cpcache.state.requests import StepOps
from cpcache.topology import Topology
from cpcache.v1 import daemon_pb2 as pb
from cpcache.v1 import daemon_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_WAIT_S = 3600.0
T = TypeVar("T")
StepLike = pb.StepRequest | pb.PrefetchRequest | pb.RevokeRequest | pb.AckRequest


class DaemonPort(Protocol):
    """What the servicer needs of the running daemon (`server.Daemon`)."""

    def admit_decision(self) -> Stepper: ...

    def in_flight(self) -> AbstractContextManager[None]: ...

    def cache_runtime(self) -> CacheRuntime: ...

    async def attach(self, model_id: str, geometry: KVGeometry, device_pages: int, kind: str,
                     pool: str | pb.CudaIpcHandle) -> Attached: ...

    def stats(self) -> dict[str, int]: ...

    def status(self) -> DaemonStatus: ...

    def placement(self) -> tuple[Topology, int]: ...


async def bounded_storage_call(runtime: CacheRuntime, fn: Callable[[], T], what: str) -> T:
    """A storage call on the storage executor (never the loop's default
    pool, which exit waits for), answered within `storage_timeout_s`: a hung
    store is UNAVAILABLE in bounded time, and a call still queued is dropped."""
    job = runtime.io.transfers.run_storage_call(fn)
    timeout_s = runtime.io.storage_timeout_s
    try:
        return await asyncio.wait_for(asyncio.wrap_future(job), timeout_s)
    except TimeoutError:
        job.cancel()
        raise Unavailable(f"{what}: storage did not answer within storage_timeout_s ({timeout_s:g}s)") from None
    except RuntimeError as exc:  # the storage executor is shut down: the daemon is stopping
        raise Unavailable(f"{what}: storage is closed ({exc})") from None


def _step_parts(request: pb.StepRequest) -> tuple[Questions, StepOps]:
    return votes_from_wire(request.votes), ops_from_wire(request)


class CacheDaemonServicer(pb_grpc.CacheDaemonServicer):
    def __init__(self, daemon: DaemonPort) -> None:
        self._daemon = daemon

    async def _step(self, method: str, request: StepLike,
                    parse: Callable[[Any], tuple[Questions, StepOps]]) -> pb.StepReply:
        """One step. A request that cannot be read still takes part in its
        round (rejected), so the other ranks are never left waiting."""
        started = time.perf_counter()
        stepper = self._daemon.admit_decision()
        invalid: CacheError | None = None
        try:
            votes, ops = parse(request)
        except CacheError as exc:
            votes, ops, invalid = Questions.empty(), StepOps(), exc
        except Exception as exc:  # a request this daemon cannot read still takes part in its round
            votes, ops, invalid = Questions.empty(), StepOps(), InvalidArgument(f"unreadable step: {exc}")
        with self._daemon.in_flight():
            outcome = await stepper.step(request.step, votes, ops, invalid=invalid,
                                         request_digest=request_digest(method, request))
        built = time.perf_counter()
        reply = step_reply(outcome)
        reply.epoch = stepper.epoch
        ended = time.perf_counter()
        stepper.phases.observe("reply", ended - built)
        stepper.phases.observe("handler", ended - started)
        return reply

    @guarded
    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> pb.StepReply:
        return await self._step("Step", request, _step_parts)

    async def Steps(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        """`Step` over one stream: each request is one step, answered in
        order with exactly what `Step` answers (a retry, by either call, is
        told apart by the same digest). A step that fails ends the stream
        with the status `Step` would have answered."""
        while (request := await context.read()) is not grpc.aio.EOF:
            try:
                if isinstance(request, Undecodable):
                    raise InvalidArgument(f"the request body does not decode: {request.error}")
                reply = await self._step("Step", request, _step_parts)
            except Exception as exc:
                if not isinstance(exc, CacheError):
                    log.exception("bug in Steps")
                await context.abort_with_status(wire_status(exc))
            else:
                await context.write(reply)

    @guarded
    async def Prefetch(self, request: pb.PrefetchRequest, context: grpc.aio.ServicerContext) -> pb.StepReply:
        return await self._step("Prefetch", request, lambda r: (
            Questions.empty(), StepOps(prefetches=prefetches_from_wire(r.prefetches), prefetch_polls=tuple(r.polls))))

    @guarded
    async def Revoke(self, request: pb.RevokeRequest, context: grpc.aio.ServicerContext) -> pb.StepReply:
        return await self._step("Revoke", request, lambda r: (Questions.empty(), StepOps(revokes=tuple(r.op_ids))))

    @guarded
    async def Ack(self, request: pb.AckRequest, context: grpc.aio.ServicerContext) -> pb.StepReply:
        return await self._step("Ack", request, lambda r: (Questions.empty(), StepOps()))

    @guarded
    async def Attach(self, request: pb.AttachRequest, context: grpc.aio.ServicerContext) -> pb.AttachReply:
        g = request.geometry
        geometry = KVGeometry(
            layers=g.layers, kv_kind=g.kv_kind, heads=g.heads, head_dim=g.head_dim, dtype=g.dtype,
            page_size=g.page_size,
        )
        if not request.model_id:
            raise InvalidArgument("attach: model_id is required (it namespaces the page keys)")
        which = request.WhichOneof("pool")
        if which is None:
            raise InvalidArgument("attach: give shm_ticket (hosts without CUDA) or cuda_ipc")
        if which == "shm_path":
            raise PermissionDenied("attach: the daemon opens no file a caller names; hand the pool over by "
                                   "descriptor (a sealed memfd) on its .pools socket and attach with the "
                                   "ticket (cpcache.client does it: attach(..., pool_fd=...))")
        if request.HasField("topology"):
            self._check_scheduler_topology(request.topology)
        attached = await self._daemon.attach(request.model_id, geometry, request.device_pages, which,
                                             getattr(request, which))
        return attach_reply(attached)

    def _check_scheduler_topology(self, declared: pb.SchedulerTopology) -> None:
        topology, rank = self._daemon.placement()
        try:
            scheduler = Topology(tp=declared.tp, cp=declared.cp, dp=declared.dp, pp=declared.pp)
        except InvalidArgument as exc:
            raise InvalidArgument(f"attach: the scheduler's {exc}") from None
        differs = topology.scheduler_mismatch(rank, scheduler, declared.rank)
        if differs:
            raise FailedPrecondition(
                f"attach: the scheduler's topology is not this daemon's: {differs}; start the daemons with "
                "the scheduler's sizes (cpcache launch --tp/--cp/--dp/--pp) and connect rank r to rank r's socket")

    @guarded
    async def WaitLoads(self, request: pb.WaitLoadsRequest, context: grpc.aio.ServicerContext) -> pb.WaitLoadsReply:
        runtime = self._daemon.cache_runtime()
        if not (math.isfinite(request.timeout_s) and 0 <= request.timeout_s <= MAX_WAIT_S):
            raise InvalidArgument(f"timeout_s must be between 0 and {MAX_WAIT_S:.0f} seconds")
        futures = []
        for op_id in request.op_ids:
            job = runtime.io.load_future(op_id)
            if job is None:
                raise NotFound(f"load {op_id} is not in flight on this rank")
            futures.append(asyncio.wrap_future(job))
        timeout = request.timeout_s or None
        try:
            results = await asyncio.wait_for(asyncio.gather(*(asyncio.shield(f) for f in futures)), timeout)
        except TimeoutError:
            raise Unavailable(f"loads {list(request.op_ids)} did not finish within {timeout}s") from None
        failed = [op_id for op_id, result in zip(request.op_ids, results) if not result.success]
        if failed:
            raise Unavailable(f"loads {failed} failed on this rank; the step that ends them reports them in "
                              f"load_failures")
        return pb.WaitLoadsReply()

    @guarded
    async def Match(self, request: pb.MatchRequest, context: grpc.aio.ServicerContext) -> pb.MatchReply:
        runtime = self._daemon.cache_runtime()
        pages = list(request.pages)
        if any(len(p) != 32 for p in pages):
            raise InvalidArgument("match: page hashes are 32-byte sha256 digests")
        host = runtime.state.match(pages)
        storage = 0
        backend = runtime.io.transfers.tiers.storage
        if backend is not None and pages and not request.host_only:
            keys = list(runtime.state.sharding.storage_keys(pages))
            storage = await bounded_storage_call(runtime, lambda: backend.exists_prefix(keys), "match")
        return pb.MatchReply(host_pages=host, storage_pages=storage)

    @guarded
    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsReply:
        return pb.StatsReply(counters=self._daemon.stats())

    @guarded
    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusReply:
        return status_reply(self._daemon.status())

