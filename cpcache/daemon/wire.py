"""Protobuf messages to the core's typed values and back. Nothing here
decides anything: a request that cannot be read raises `InvalidArgument`,
and the servicer carries that into the step's round as a rejection."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from google.protobuf.message import Message

from cpcache.agreement.rounds import Questions
from cpcache.errors import CacheError, InvalidArgument, PermissionDenied
from cpcache.geometry import KV_KINDS, KVGeometry, PagePart, Region, check_part_count
from cpcache.hashing import hash62
from cpcache.rank.attach import Attached
from cpcache.rank.stepper import StepAnswer
from cpcache.requests import CacheRequests, LoadRequest, PrefetchRequest, WriteRequest, check_page_hash
from cpcache.v1 import daemon_pb2 as pb


def votes_from_wire(votes: pb.Votes) -> Questions:
    # The wire's Reduce numbers are the core's (REDUCE_MIN = 1, REDUCE_MAX = 2);
    # anything else is refused by the validation in `Questions.votes`.
    return Questions.votes(votes.op_ids, votes.reduces, votes.values)


def _parent(raw: bytes) -> bytes | None:
    """The wire's empty bytes mean no parent."""
    if raw:
        check_page_hash(raw, "parent")
    return raw or None


def prefetches_from_wire(prefetches: Iterable[pb.PrefetchOp]) -> tuple[PrefetchRequest, ...]:
    return tuple(PrefetchRequest(p.op_id, tuple(p.pages), p.tokens, _parent(p.parent), p.hold) for p in prefetches)


def requests_from_wire(request: pb.StepRequest) -> CacheRequests:
    return CacheRequests(
        prefetches=prefetches_from_wire(request.prefetches),
        prefetch_polls=tuple(request.prefetch_polls),
        revokes=tuple(request.revokes),
        writes=tuple(WriteRequest(w.op_id, tuple(w.pages), tuple(w.device_pages), _parent(w.parent))
                     for w in request.writes),
        loads=tuple(LoadRequest(x.op_id, tuple(x.pages), tuple(x.device_pages), x.signal_slot) for x in request.loads),
        hold_releases=tuple(request.hold_releases),
    )


def cuda_ipc_from_wire(handle: pb.CudaIpcHandle) -> dict[str, Any]:
    """The fields of `UntypedStorage._share_cuda_()`, as plain values."""
    return {f.name: getattr(handle, f.name) for f in handle.DESCRIPTOR.fields}


def regions_from_wire(regions: Iterable[pb.PoolRegion]) -> list[Region]:
    return [Region(r.offset, tuple(r.strides), cuda_ipc_from_wire(r.cuda_ipc) if r.HasField("cuda_ipc") else None)
            for r in regions]


@dataclass(frozen=True)
class ShmPool:
    """A sealed memfd pool, handed over on the `.pools` socket."""

    ticket: str
    kind = "shm_ticket"


@dataclass(frozen=True)
class CudaPool:
    """CUDA storage: one IPC handle's fields for the pool, or None when
    every region names its own storage."""

    handle: dict[str, Any] | None
    kind = "cuda_ipc"


@dataclass(frozen=True)
class SignalsAsk:
    """The load-signal board an Attach hands over (`LoadSignals`)."""

    ticket: str
    slots: int
    cuda_events: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class AttachAsk:
    """What an `AttachRequest` asks for, read and checked."""

    model_id: str
    geometry: KVGeometry
    device_pages: int
    pool: ShmPool | CudaPool
    regions: list[Region]
    signals: SignalsAsk | None = None
    model_dtype: str = ""  # "" from a client that does not send it
    attempt: int = 0  # AttachRequest.attempt: a retry repeats it (0: none)


def attach_from_wire(request: pb.AttachRequest) -> AttachAsk:
    g = request.geometry
    if g.kv_kind not in KV_KINDS:
        raise InvalidArgument(f"geometry: kv_kind must be one of {', '.join(KV_KINDS)}, got {g.kv_kind!r}")
    check_part_count(len(g.beside))  # before any work that grows with them
    beside = tuple(PagePart(p.name, p.rows_per_page, p.width, p.dtype) for p in g.beside)
    geometry = KVGeometry(layers=g.layers, kv_kind=g.kv_kind, heads=g.heads, head_dim=g.head_dim, dtype=g.dtype,
                          page_size=g.page_size, beside=beside)
    if not request.model_id:
        raise InvalidArgument("attach: model_id is required (it namespaces the page keys)")
    kind = request.WhichOneof("pool")
    regions = regions_from_wire(request.regions)
    per_layer_ipc = [r.cuda_ipc is not None for r in regions]
    if any(per_layer_ipc) and not all(per_layer_ipc):
        raise InvalidArgument("attach: a CUDA IPC handle in every region or in none")
    if kind is None and regions and all(per_layer_ipc):
        kind = "cuda_ipc"  # a storage per layer, each region naming its own
    elif kind is None:
        raise InvalidArgument("attach: give shm_ticket (hosts without CUDA), cuda_ipc, or a CUDA IPC handle "
                              "in every region")
    elif any(per_layer_ipc):
        raise InvalidArgument(f"attach: regions with their own CUDA IPC handles take no {kind}")
    if kind == "shm_path":
        raise PermissionDenied("attach: the daemon opens no file a caller names; hand the pool over by "
                               "descriptor (a sealed memfd) on its .pools socket and attach with the "
                               "ticket (cpcache.client does it: attach(..., pool_fd=...))")
    pool: ShmPool | CudaPool = ShmPool(request.shm_ticket)
    if kind == "cuda_ipc":
        pool = CudaPool(cuda_ipc_from_wire(request.cuda_ipc) if request.HasField("cuda_ipc") else None)
    return AttachAsk(request.model_id, geometry, request.device_pages, pool, regions,
                     signals_from_wire(request.load_signals) if request.HasField("load_signals") else None,
                     request.model_dtype, request.attempt)


def signals_from_wire(signals: pb.LoadSignals) -> SignalsAsk:
    if not signals.shm_ticket:
        raise InvalidArgument("attach: load_signals needs the ticket of its board, handed over by descriptor on the "
                              "daemon's .pools socket (cpcache.client does it: attach(..., load_signals=...))")
    if signals.slots < 1:
        raise InvalidArgument("attach: load_signals needs at least one slot")
    return SignalsAsk(signals.shm_ticket, signals.slots, tuple(signals.cuda_events))


def request_digest(method: str, request: Message) -> int:
    """What tells a retry of a step from a different step with its number."""
    return hash62(method.encode() + request.SerializeToString(deterministic=True))


def step_reply(answer: StepAnswer) -> pb.StepReply:
    reply = pb.StepReply(step=answer.step, round=answer.round, state_digest=answer.digest, epoch=answer.epoch)
    reply.decisions.op_ids.extend(answer.op_ids.tolist())
    reply.decisions.values.extend(answer.values.tolist())
    d = answer.decided
    for op_id, pages in d.prefetch_hits:
        reply.prefetches.add(op_id=op_id, outcome=pb.PrefetchDecision.HIT, pages=pages)
    for op_id, pages in d.prefetch_done:
        reply.prefetches.add(op_id=op_id, outcome=pb.PrefetchDecision.DONE, pages=pages)
    for op_id, why in d.prefetch_revoked:
        reply.prefetches.add(op_id=op_id, outcome=pb.PrefetchDecision.REVOKED, reason=why)
    reply.write_acks.extend(d.write_acks)
    reply.write_failures.extend(d.write_failures)
    for (op_id, stored), written in zip(d.backups, d.backup_pages or [()] * len(d.backups)):
        reply.backups.add(op_id=op_id, stored=stored, pages=written)
    for op_id, pages in d.loads:
        reply.loads.add(op_id=op_id, pages=pages)
    reply.load_failures.extend(d.load_failures)
    reply.host_entered.extend(d.host_entered)
    reply.host_entered_slots.extend(d.host_entered_slots)
    reply.host_left.extend(d.host_left)
    reply.daemon_open = d.daemon_open
    return reply


def step_error(exc: CacheError) -> pb.StepError:
    """A step's error as data (an `Outcome` carries it; the client
    rebuilds the same typed error from it)."""
    return pb.StepError(status=exc.status, reason=exc.reason, message=str(exc), metadata=exc.metadata())


def attach_reply(attached: Attached) -> pb.AttachReply:
    return pb.AttachReply(**asdict(attached))


@dataclass(frozen=True)
class DaemonStatus:
    rank: int
    world_size: int
    domain_ranks: tuple[int, ...]
    mode: str
    agreement_lag: int
    last_step: int
    rounds_completed: int
    open_questions: int
    state: str
    failure: str
    metrics_port: int
    attached: bool
    epoch: int = 0
    agreement_timeout_s: float = 0.0
    version: str = ""  # the cpcache release the daemon runs


def status_reply(status: DaemonStatus) -> pb.StatusReply:
    return pb.StatusReply(**asdict(status))
