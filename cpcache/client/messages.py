"""The messages of a scheduler iteration on the wire: a `Step` built from
the operations it carries (`cpcache.requests.CacheRequests`, the types the
daemon reads them back into), the reply as the scheduler reads it
(`StepResult`), and the attach request."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cpcache.requests import CacheRequests
from cpcache.topology import Topology
from cpcache.v1 import daemon_pb2 as pb
from cpcache.values import Reduce

if TYPE_CHECKING:
    from cpcache.geometry import KVGeometry, Region

_REDUCE_TO_WIRE = {Reduce.MIN: pb.REDUCE_MIN, Reduce.MAX: pb.REDUCE_MAX}


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
    write_failures: tuple[int, ...] = ()  # nothing of these entered the host pool (a failed copy, a full pool)
    load_failures: tuple[int, ...] = ()  # the device pages of these hold no agreed data
    epoch: int = 0  # the domain's epoch: it moves when the domain re-forms after losing a rank
    host_entered: tuple[bytes, ...] = ()  # pages that entered the host pool in `round`
    host_left: tuple[bytes, ...] = ()  # pages evicted from it in `round`
    host_entered_slots: tuple[int, ...] = ()  # the host slot of each page of host_entered
    backup_pages: dict[int, tuple[bytes, ...]] = field(default_factory=dict)  # backup op -> the pages it wrote
    daemon_open: int = 0  # backups the daemon opened itself (of written or loaded pages) later rounds decide


def step_request(step: int, votes: Iterable[tuple[int, Reduce, int]] = (),
                 requests: CacheRequests | None = None, epoch: int | None = None) -> pb.StepRequest:
    """`epoch`: the one the session was attached in (None: unchecked)."""
    request = pb.StepRequest(step=step, epoch=epoch)
    if requests is not None:
        for p in requests.prefetches:
            request.prefetches.add(op_id=p.op_id, pages=p.pages, tokens=p.tokens, parent=p.parent or b"", hold=p.hold)
        request.prefetch_polls.extend(requests.prefetch_polls)
        request.revokes.extend(requests.revokes)
        request.hold_releases.extend(requests.hold_releases)
        for w in requests.writes:
            request.writes.add(op_id=w.op_id, pages=w.pages, device_pages=w.device_pages, parent=w.parent or b"")
        for x in requests.loads:
            request.loads.add(op_id=x.op_id, pages=x.pages, device_pages=x.device_pages, signal_slot=x.signal_slot)
    votes = list(votes)
    if votes:
        op_ids, reduces, values = zip(*votes)
        request.votes.op_ids.extend(op_ids)
        request.votes.reduces.extend(_REDUCE_TO_WIRE[Reduce(r)] for r in reduces)
        request.votes.values.extend(values)
    return request


def step_result(reply: pb.StepReply) -> StepResult:
    hits: dict[int, int] = {}
    done: dict[int, int] = {}
    revoked: dict[int, str] = {}
    pages_by_outcome = {pb.PrefetchDecision.HIT: hits, pb.PrefetchDecision.DONE: done}
    for d in reply.prefetches:
        if d.outcome == pb.PrefetchDecision.REVOKED:
            revoked[d.op_id] = d.reason
        else:
            pages_by_outcome[d.outcome][d.op_id] = d.pages
    return StepResult(
        step=reply.step,
        round=reply.round,
        decisions=dict(zip(reply.decisions.op_ids, reply.decisions.values)),
        digest=reply.state_digest,
        wire=reply.SerializeToString(deterministic=True),
        prefetch_hits=hits,
        prefetch_done=done,
        prefetch_revoked=revoked,
        write_acks=tuple(reply.write_acks),
        backups={b.op_id: b.stored for b in reply.backups},
        loads={x.op_id: x.pages for x in reply.loads},
        write_failures=tuple(reply.write_failures),
        load_failures=tuple(reply.load_failures),
        epoch=reply.epoch,
        host_entered=tuple(reply.host_entered),
        host_left=tuple(reply.host_left),
        host_entered_slots=tuple(reply.host_entered_slots),
        backup_pages={b.op_id: tuple(b.pages) for b in reply.backups},
        daemon_open=reply.daemon_open,
    )


def attach_request(model_id: str, geometry: KVGeometry, device_pages: int, shm_ticket: str = "",
                   cuda_ipc: dict[str, Any] | None = None,
                   placement: tuple[Topology, int] | None = None,
                   regions: Sequence[Region] = (), load_signals: tuple[str, int, Sequence[bytes]] | None = None,
                   model_dtype: str = "") -> pb.AttachRequest:
    request = pb.AttachRequest(model_id=model_id, model_dtype=model_dtype, device_pages=device_pages,
                               geometry=pb.Geometry(
        layers=geometry.layers, kv_kind=geometry.kv_kind, heads=geometry.heads, head_dim=geometry.head_dim,
        dtype=geometry.dtype, page_size=geometry.page_size,
        beside=[pb.PagePart(name=p.name, rows_per_page=p.rows_per_page, width=p.width, dtype=p.dtype)
                for p in geometry.beside]))
    if placement is not None:
        topology, rank = placement
        request.topology.CopyFrom(pb.SchedulerTopology(tp=topology.tp, cp=topology.cp, dp=topology.dp,
                                                       pp=topology.pp, rank=rank))
    for region in regions:
        wire = request.regions.add(offset=region.offset, strides=region.strides)
        if region.cuda_ipc is not None:
            wire.cuda_ipc.CopyFrom(pb.CudaIpcHandle(**region.cuda_ipc))
    if cuda_ipc is not None:
        request.cuda_ipc.CopyFrom(pb.CudaIpcHandle(**cuda_ipc))
    elif shm_ticket:
        request.shm_ticket = shm_ticket
    if load_signals is not None:
        ticket, slots, events = load_signals
        request.load_signals.CopyFrom(pb.LoadSignals(shm_ticket=ticket, slots=slots, cuda_events=events))
    return request
