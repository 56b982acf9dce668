"""Scheduler-side clients of one rank's daemon: `AsyncClient` for asyncio
schedulers, `Client` for synchronous scheduler loops.

Both raise the same `cpcache.errors` family the daemon raises, rebuilt from
the status code, so a scheduler handles `Unavailable` or `Divergence` without
knowing gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cpcache import errors
from cpcache.values import Reduce
from cpcache.v1 import daemon_pb2 as pb
from cpcache.v1 import daemon_pb2_grpc as pb_grpc

_ERROR_OF: dict[grpc.StatusCode, type[errors.CacheError]] = {}
for _kind in errors.FAMILY:
    if _kind.__bases__ == (errors.CacheError,):  # the subclasses are told apart by their reason
        _ERROR_OF[grpc.StatusCode[_kind.status]] = _kind
_ERROR_OF[grpc.StatusCode.DEADLINE_EXCEEDED] = errors.Unavailable
_REDUCE_TO_WIRE = {Reduce.MIN: pb.REDUCE_MIN, Reduce.MAX: pb.REDUCE_MAX}

# Reconnect quickly: the daemon is local and may be restarting.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 500),
]


def target_of(address: str) -> str:
    """A socket path, `unix:PATH`, or `host:port`."""
    if address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return address
    if address.startswith("/") or address.endswith(".sock"):
        return "unix:" + address
    return address


def error_from(exc: grpc.RpcError) -> errors.CacheError:
    kind = _ERROR_OF.get(exc.code(), errors.CacheError)
    if kind is errors.FailedPrecondition and "divergence" in (exc.details() or ""):
        kind = errors.Divergence
    return kind(f"{exc.code().name}: {exc.details()}")


@dataclass(frozen=True)
class StepResult:
    step: int
    round: int  # the step whose round these decisions come from; 0: none yet
    decisions: dict[int, int]  # vote op id -> agreed value
    digest: int
    wire: bytes  # the reply as sent, for byte-for-byte comparisons across ranks
    prefetch_hits: dict[int, int] = field(default_factory=dict)  # op -> pages in storage
    prefetch_done: dict[int, int] = field(default_factory=dict)  # op -> pages now in host
    prefetch_revoked: dict[int, str] = field(default_factory=dict)  # op -> why
    write_acks: tuple[int, ...] = ()
    backups: dict[int, bool] = field(default_factory=dict)
    loads: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Ops:
    """Cache operations for one step (see `StepOps` in cpcache.cache)."""

    prefetches: tuple = ()  # (op_id, pages, tokens[, parent])
    polls: tuple = ()  # prefetch op ids
    revokes: tuple = ()  # prefetch op ids
    writes: tuple = ()  # (op_id, pages, device_pages[, parent])
    loads: tuple = ()  # (op_id, pages, device_pages)


def step_request(step: int, votes: Iterable[tuple[int, Reduce, int]] = (), ops: Ops | None = None) -> pb.StepRequest:
    request = pb.StepRequest(step=step)
    if ops is not None:
        for op_id, pages, tokens, *parent in ops.prefetches:
            request.prefetches.add(op_id=op_id, pages=pages, tokens=tokens, parent=parent[0] if parent else b"")
        request.prefetch_polls.extend(ops.polls)
        request.revokes.extend(ops.revokes)
        for op_id, pages, device_pages, *parent in ops.writes:
            request.writes.add(op_id=op_id, pages=pages, device_pages=device_pages,
                               parent=parent[0] if parent and parent[0] else b"")
        for op_id, pages, device_pages in ops.loads:
            request.loads.add(op_id=op_id, pages=pages, device_pages=device_pages)
    votes = list(votes)
    if votes:
        op_ids, reduces, values = zip(*votes)
        request.votes.op_ids.extend(op_ids)
        request.votes.reduces.extend(_REDUCE_TO_WIRE[Reduce(r)] for r in reduces)
        request.votes.values.extend(values)
    return request


def step_result(reply: pb.StepReply) -> StepResult:
    by_outcome = {pb.PrefetchDecision.HIT: {}, pb.PrefetchDecision.DONE: {}, pb.PrefetchDecision.REVOKED: {}}
    for d in reply.prefetches:
        by_outcome[d.outcome][d.op_id] = d.reason if d.outcome == pb.PrefetchDecision.REVOKED else d.pages
    return StepResult(
        step=reply.step,
        round=reply.round,
        decisions=dict(zip(reply.decisions.op_ids, reply.decisions.values)),
        digest=reply.state_digest,
        wire=reply.SerializeToString(deterministic=True),
        prefetch_hits=by_outcome[pb.PrefetchDecision.HIT],
        prefetch_done=by_outcome[pb.PrefetchDecision.DONE],
        prefetch_revoked=by_outcome[pb.PrefetchDecision.REVOKED],
        write_acks=tuple(reply.write_acks),
        backups={b.op_id: b.stored for b in reply.backups},
        loads={x.op_id: x.pages for x in reply.loads},
    )


def attach_request(model_id: str, geometry, device_pages: int, shm_path: str = "", cuda_ipc: dict | None = None):
    request = pb.AttachRequest(model_id=model_id, device_pages=device_pages, geometry=pb.Geometry(
        layers=geometry.layers, kv_kind=geometry.kv_kind, heads=geometry.heads, head_dim=geometry.head_dim,
        dtype=geometry.dtype, page_size=geometry.page_size))
    if cuda_ipc is not None:
        request.cuda_ipc.CopyFrom(pb.CudaIpcHandle(**cuda_ipc))
    else:
        request.shm_path = shm_path
    return request


def _metadata(token: str | None):
    return (("authorization", f"Bearer {token}"),) if token else None


class AsyncClient:
    def __init__(self, address: str, token: str | None = None, credentials=None, timeout_s: float | None = None):
        target = target_of(address)
        if credentials is not None:
            self._channel = grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.CacheDaemonStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = _metadata(token)
        self._timeout_s = timeout_s

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method, request):
        try:
            return await method(request, timeout=self._timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise error_from(exc) from None

    async def step(self, step: int, votes: Iterable[tuple[int, Reduce, int]] = (), ops: Ops | None = None) -> StepResult:
        return step_result(await self._call(self._stub.Step, step_request(step, votes, ops)))

    async def attach(self, model_id: str, geometry, device_pages: int, shm_path: str = "", cuda_ipc=None):
        return await self._call(self._stub.Attach, attach_request(model_id, geometry, device_pages, shm_path, cuda_ipc))

    async def wait_loads(self, op_ids, timeout_s: float = 30.0) -> None:
        await self._call(self._stub.WaitLoads, pb.WaitLoadsRequest(op_ids=op_ids, timeout_s=timeout_s))

    async def match(self, pages) -> pb.MatchReply:
        return await self._call(self._stub.Match, pb.MatchRequest(pages=pages))

    async def stats(self) -> dict[str, int]:
        return dict((await self._call(self._stub.Stats, pb.StatsRequest())).counters)

    async def status(self) -> pb.StatusReply:
        return await self._call(self._stub.Status, pb.StatusRequest())

    async def health(self, service: str = "") -> int:
        reply = await self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service))
        return reply.status

    async def wait_serving(self, timeout_s: float) -> None:
        """Wait until the daemon reports SERVING: waits for the socket to
        appear and for the health status to change, without polling."""
        call = self._health.Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s, wait_for_ready=True, metadata=self._metadata
        )
        try:
            async for reply in call:
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.aio.AioRpcError as exc:
            raise error_from(exc) from None
        finally:
            call.cancel()
        raise errors.Unavailable("the daemon closed its health stream before serving")


class Client:
    """Blocking client with the same calls, for synchronous scheduler loops."""

    def __init__(self, address: str, token: str | None = None, credentials=None, timeout_s: float | None = None):
        target = target_of(address)
        if credentials is not None:
            self._channel = grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.CacheDaemonStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = _metadata(token)
        self._timeout_s = timeout_s

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method, request):
        try:
            return method(request, timeout=self._timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from(exc) from None

    def step(self, step: int, votes: Iterable[tuple[int, Reduce, int]] = (), ops: Ops | None = None) -> StepResult:
        return step_result(self._call(self._stub.Step, step_request(step, votes, ops)))

    def attach(self, model_id: str, geometry, device_pages: int, shm_path: str = "", cuda_ipc=None):
        return self._call(self._stub.Attach, attach_request(model_id, geometry, device_pages, shm_path, cuda_ipc))

    def wait_loads(self, op_ids, timeout_s: float = 30.0) -> None:
        self._call(self._stub.WaitLoads, pb.WaitLoadsRequest(op_ids=op_ids, timeout_s=timeout_s))

    def match(self, pages) -> pb.MatchReply:
        return self._call(self._stub.Match, pb.MatchRequest(pages=pages))

    def stats(self) -> dict[str, int]:
        return dict(self._call(self._stub.Stats, pb.StatsRequest()).counters)

    def status(self) -> pb.StatusReply:
        return self._call(self._stub.Status, pb.StatusRequest())

    def health(self, service: str = "") -> int:
        return self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service)).status
