"""The CacheDaemon servicer: a thin translation between protobuf messages and
the rank (`cpcache.rank.rank.Rank`). Validation, decisions and I/O live
there; this module only reads messages, writes replies and times the wire's
part of a step."""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractContextManager
from typing import Any, Protocol

import grpc

from cpcache.agreement.rounds import Questions
from cpcache.daemon.call_limits import CallCounts, idle_status
from cpcache.daemon.status import decoded, guarded
from cpcache.daemon.wire import (
    AttachAsk,
    DaemonStatus,
    attach_from_wire,
    attach_reply,
    request_digest,
    requests_from_wire,
    status_reply,
    step_error,
    step_reply,
    votes_from_wire,
)
from cpcache.errors import CacheError, InvalidArgument, NotFound, Unavailable
from cpcache.rank.attach import Attached
from cpcache.rank.rank import Rank
from cpcache.requests import CacheRequests
from cpcache.topology import Topology
from cpcache.v1 import daemon_pb2 as pb
from cpcache.v1 import daemon_pb2_grpc as pb_grpc
from cpcache.values import NOT_TAKEN


class DaemonPort(Protocol):
    """What the servicer needs of the running daemon (`server.Daemon`)."""

    @property
    def rank(self) -> Rank: ...

    def in_flight(self) -> AbstractContextManager[None]: ...

    async def attach_pool(self, ask: AttachAsk) -> Attached: ...

    def stats(self) -> dict[str, int]: ...

    def status(self) -> DaemonStatus: ...


class CacheDaemonServicer(pb_grpc.CacheDaemonServicer):
    def __init__(self, daemon: DaemonPort, steps_idle_s: float | None = None,
                 calls: CallCounts | None = None) -> None:
        """`steps_idle_s`: a `Steps` stream that waits this long for a step
        is closed (None: never); counted in `calls`."""
        self._daemon = daemon
        self._steps_idle_s = steps_idle_s
        self._calls = calls

    async def _step(self, request: pb.StepRequest) -> pb.StepReply:
        """One step. A request that cannot be read still takes part in its
        round (rejected), so the other ranks are never left waiting."""
        started = time.perf_counter()
        invalid: CacheError | None = None
        try:
            votes, requests = votes_from_wire(request.votes), requests_from_wire(request)
        except CacheError as exc:
            votes, requests, invalid = Questions.empty(), CacheRequests(), exc
        except Exception as exc:  # a request this daemon cannot read still takes part in its round
            votes, requests, invalid = Questions.empty(), CacheRequests(), InvalidArgument(f"unreadable step: {exc}")
        with self._daemon.in_flight():
            answer, phases = await self._daemon.rank.step(
                request.step, votes, requests, invalid=invalid, request_digest=request_digest("Step", request),
                epoch=request.epoch if request.HasField("epoch") else None)
        built = time.perf_counter()
        reply = step_reply(answer)
        ended = time.perf_counter()
        phases.observe("reply", ended - built)
        phases.observe("handler", ended - started)
        return reply

    @guarded
    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> pb.StepReply:
        return await self._step(request)

    @guarded
    async def Steps(self, request_stream: Any, context: grpc.aio.ServicerContext) -> None:
        """`Step` over one stream: each request is one step, answered in
        order with exactly what `Step` answers (a retry, by either call, is
        told apart by the same digest). A step that fails ends the stream
        with the status `Step` would have answered (`guarded`)."""
        while (request := await self._next_step(context)) is not grpc.aio.EOF:
            await context.write(await self._step(decoded(request)))

    async def _next_step(self, context: grpc.aio.ServicerContext) -> Any:
        """The stream's next request. One that does not come within
        `steps_idle_s` ends the stream (UNAVAILABLE, reason STREAM_IDLE),
        so an idle stream holds no slot for long: only while it waits for a
        request, never while a step runs."""
        if self._steps_idle_s is None:
            return await context.read()
        try:
            return await asyncio.wait_for(context.read(), self._steps_idle_s)
        except TimeoutError:
            if self._calls is not None:
                self._calls.steps_closed_idle += 1
            await context.abort_with_status(idle_status(self._steps_idle_s))

    @guarded
    async def Attach(self, request: pb.AttachRequest, context: grpc.aio.ServicerContext) -> pb.AttachReply:
        ask = attach_from_wire(request)
        if request.HasField("topology"):
            self._check_scheduler_topology(request.topology)
        return attach_reply(await self._daemon.attach_pool(ask))

    def _check_scheduler_topology(self, declared: pb.SchedulerTopology) -> None:
        try:
            scheduler = Topology(tp=declared.tp, cp=declared.cp, dp=declared.dp, pp=declared.pp)
        except InvalidArgument as exc:
            raise InvalidArgument(f"attach: the scheduler's {exc}") from None
        self._daemon.rank.check_scheduler(scheduler, declared.rank)

    @guarded
    async def WaitLoads(self, request: pb.WaitLoadsRequest, context: grpc.aio.ServicerContext) -> pb.WaitLoadsReply:
        await self._daemon.rank.wait_loads(request.op_ids, request.timeout_s)
        return pb.WaitLoadsReply()

    @guarded
    async def Match(self, request: pb.MatchRequest, context: grpc.aio.ServicerContext) -> pb.MatchReply:
        host, storage = await self._daemon.rank.match(request.pages, request.host_only)
        return pb.MatchReply(host_pages=host, storage_pages=storage)

    @guarded
    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsReply:
        return pb.StatsReply(counters=self._daemon.stats())

    @guarded
    async def Outcome(self, request: pb.OutcomeRequest, context: grpc.aio.ServicerContext) -> pb.OutcomeReply:
        """How a step of this rank's domain ended, for a peer's scheduler
        that never heard (its daemon died): the reply, or the error, that
        this rank's scheduler is (or will be) given for it."""
        fence_for: int | None = None
        if request.fence:  # the asker's daemon is gone: a step not taken here fails for good
            fence_for = request.asking_rank if request.HasField("asking_rank") else -1
        try:
            kept = self._daemon.rank.outcome(request.epoch, request.step, fence_for)
        except NotFound as exc:
            if self._daemon.rank.config.agreement_lag:
                # At lag >= 1 the step answers an earlier round, which may
                # have completed without this rank's step: no telling yet,
                # but once this rank's scheduler sends the step, this rank
                # answers it (the asker waits for that, never guesses).
                error = step_error(Unavailable(f"{exc}; at agreement_lag >= 1 it is told once this rank takes it"))
                error.metadata[NOT_TAKEN] = "1"
                return pb.OutcomeReply(error=error)
            # Not taken here at lag 0: its round cannot complete without this
            # rank. Asked to fence, the step can no longer be taken here (the
            # epoch was left): final. Otherwise the asker's living daemon may
            # still take part in it with this rank.
            error = step_error(Unavailable(str(exc)))
            if fence_for is None:
                error.metadata[NOT_TAKEN] = "1"
            return pb.OutcomeReply(error=error)
        try:
            answer = await asyncio.shield(kept)
        except CacheError as exc:
            return pb.OutcomeReply(error=step_error(exc))
        return pb.OutcomeReply(reply=step_reply(answer))

    @guarded
    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusReply:
        return status_reply(self._daemon.status())

