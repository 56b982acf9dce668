"""The CacheDaemon servicer: a thin translation between protobuf messages and
the core. Validation and decisions live in the core."""

from __future__ import annotations

import asyncio

from cpcache.state.machine import LoadRequest, PrefetchRequest, StepOps, WriteRequest
from cpcache.rank.stepper import Coordinator, StepOutcome
from cpcache.daemon.status import guarded
from cpcache.errors import InvalidArgument, NotFound, Unavailable
from cpcache.geometry import KVGeometry
from cpcache.agreement.rounds import Questions
from cpcache.v1 import daemon_pb2 as pb
from cpcache.v1 import daemon_pb2_grpc as pb_grpc

MAX_OPS_PER_STEP = 4096


def votes_from_wire(votes: pb.Votes) -> Questions:
    # The wire's Reduce numbers are the core's (REDUCE_MIN = 1, REDUCE_MAX = 2);
    # anything else is refused by the validation in `Questions.votes`.
    return Questions.votes(votes.op_ids, votes.reduces, votes.values)


def _parent(raw: bytes) -> bytes | None:
    if raw and len(raw) != 32:
        raise InvalidArgument("parent must be a 32-byte page hash or empty")
    return raw or None


def prefetches_from_wire(prefetches) -> tuple[PrefetchRequest, ...]:
    return tuple(PrefetchRequest(p.op_id, tuple(p.pages), p.tokens, _parent(p.parent)) for p in prefetches)


def ops_from_wire(request: pb.StepRequest) -> StepOps:
    count = (len(request.prefetches) + len(request.writes) + len(request.loads) + len(request.revokes)
             + len(request.prefetch_polls))
    if count > MAX_OPS_PER_STEP:
        raise InvalidArgument(f"a step carries at most {MAX_OPS_PER_STEP} operations, got {count}")
    return StepOps(
        prefetches=prefetches_from_wire(request.prefetches),
        prefetch_polls=tuple(request.prefetch_polls),
        revokes=tuple(request.revokes),
        writes=tuple(WriteRequest(w.op_id, tuple(w.pages), tuple(w.device_pages), _parent(w.parent))
                     for w in request.writes),
        loads=tuple(LoadRequest(x.op_id, tuple(x.pages), tuple(x.device_pages)) for x in request.loads),
    )


_OUTCOME_HIT, _OUTCOME_DONE, _OUTCOME_REVOKED = (
    pb.PrefetchDecision.HIT,
    pb.PrefetchDecision.DONE,
    pb.PrefetchDecision.REVOKED,
)


def step_reply(outcome: StepOutcome) -> pb.StepReply:
    reply = pb.StepReply(step=outcome.step, round=outcome.round, state_digest=outcome.digest)
    reply.decisions.op_ids.extend(outcome.op_ids.tolist())
    reply.decisions.values.extend(outcome.values.tolist())
    d = outcome.cache
    for op_id, pages in d.prefetch_hits:
        reply.prefetches.add(op_id=op_id, outcome=_OUTCOME_HIT, pages=pages)
    for op_id, pages in d.prefetch_done:
        reply.prefetches.add(op_id=op_id, outcome=_OUTCOME_DONE, pages=pages)
    for op_id, why in d.prefetch_revoked:
        reply.prefetches.add(op_id=op_id, outcome=_OUTCOME_REVOKED, reason=why)
    reply.write_acks.extend(d.write_acks)
    for op_id, stored in d.backups:
        reply.backups.add(op_id=op_id, stored=stored)
    for op_id, pages in d.loads:
        reply.loads.add(op_id=op_id, pages=pages)
    return reply


class CacheDaemonServicer(pb_grpc.CacheDaemonServicer):
    def __init__(self, daemon) -> None:
        """`daemon` is the running `cpcache.daemon.server.Daemon`."""
        self._daemon = daemon

    def count_rpc(self, method: str, code: str) -> None:
        self._daemon.metrics.rpcs[(method, code)] += 1

    async def _step(self, step: int, votes: Questions, ops: StepOps) -> pb.StepReply:
        coordinator: Coordinator = self._daemon.admit_decision()
        if step == 0:
            raise InvalidArgument("step must be >= 1")
        with self._daemon.in_flight():
            return step_reply(await coordinator.step(step, votes, ops))

    @guarded
    async def Step(self, request: pb.StepRequest, context) -> pb.StepReply:
        return await self._step(request.step, votes_from_wire(request.votes), ops_from_wire(request))

    @guarded
    async def Prefetch(self, request: pb.PrefetchRequest, context) -> pb.StepReply:
        if len(request.prefetches) + len(request.polls) > MAX_OPS_PER_STEP:
            raise InvalidArgument(f"a step carries at most {MAX_OPS_PER_STEP} operations")
        ops = StepOps(prefetches=prefetches_from_wire(request.prefetches), prefetch_polls=tuple(request.polls))
        return await self._step(request.step, Questions.empty(), ops)

    @guarded
    async def Revoke(self, request: pb.RevokeRequest, context) -> pb.StepReply:
        return await self._step(request.step, Questions.empty(), StepOps(revokes=tuple(request.op_ids)))

    @guarded
    async def Ack(self, request: pb.AckRequest, context) -> pb.StepReply:
        return await self._step(request.step, Questions.empty(), StepOps())

    @guarded
    async def Attach(self, request: pb.AttachRequest, context) -> pb.AttachReply:
        g = request.geometry
        geometry = KVGeometry(
            layers=g.layers, kv_kind=g.kv_kind, heads=g.heads, head_dim=g.head_dim, dtype=g.dtype,
            page_size=g.page_size,
        )
        if not request.model_id:
            raise InvalidArgument("attach: model_id is required (it namespaces the page keys)")
        which = request.WhichOneof("pool")
        if which is None:
            raise InvalidArgument("attach: give shm_path (hosts without CUDA) or cuda_ipc")
        return await self._daemon.attach(request.model_id, geometry, request.device_pages, which,
                                         getattr(request, which))

    @guarded
    async def WaitLoads(self, request: pb.WaitLoadsRequest, context) -> pb.WaitLoadsReply:
        runtime = self._daemon.cache_runtime()
        futures = []
        for op_id in request.op_ids:
            job = runtime.io.load_future(op_id)
            if job is None:
                raise NotFound(f"load {op_id} is not in flight on this rank")
            futures.append(asyncio.wrap_future(job))
        timeout = request.timeout_s or None
        try:
            await asyncio.wait_for(asyncio.gather(*(asyncio.shield(f) for f in futures)), timeout)
        except asyncio.TimeoutError:
            raise Unavailable(f"loads {list(request.op_ids)} did not finish within {timeout}s") from None
        return pb.WaitLoadsReply()

    @guarded
    async def Match(self, request: pb.MatchRequest, context) -> pb.MatchReply:
        runtime = self._daemon.cache_runtime()
        pages = list(request.pages)
        if any(len(p) != 32 for p in pages):
            raise InvalidArgument("match: page hashes are 32-byte sha256 digests")
        host = runtime.state.match(pages)
        storage = 0
        backend = runtime.io.transfers.tiers.storage
        if backend is not None and pages:
            keys = [runtime.state.storage_key(p) for p in pages]
            storage = await asyncio.to_thread(backend.exists_prefix, keys)
        return pb.MatchReply(host_pages=host, storage_pages=storage)

    @guarded
    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsReply:
        return pb.StatsReply(counters=self._daemon.stats())

    @guarded
    async def Status(self, request: pb.StatusRequest, context) -> pb.StatusReply:
        return self._daemon.status()

