"""Each call of the daemon's API as a `Call`: its RPC, its request built
from the messages of `messages.py`, how its reply is read, and its
deadline. Both client faces (`core.py`) send these, and nothing else."""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from grpc_health.v1 import health_pb2

from cpcache import errors
from cpcache.client.messages import StepResult, attach_request, step_request, step_result
from cpcache.client.pools import hand_over
from cpcache.load_signals import LoadSignals
from cpcache.requests import CacheRequests
from cpcache.topology import Topology
from cpcache.v1 import daemon_pb2 as pb
from cpcache.values import Reduce

if TYPE_CHECKING:
    from cpcache.geometry import KVGeometry, Region

T = TypeVar("T")

WAIT_MARGIN_S = 5.0  # wait_loads' deadline: its own timeout plus this, for the daemon to answer


@dataclass(frozen=True)
class Call(Generic[T]):
    """One unary call, ready to send: the RPC, its request, how to read the
    reply, and its deadline (None: the client's). `prepare`, if any, makes
    the request first from the daemon's address: blocking work (a pool
    handed over on the daemon's socket), which the asyncio face runs on a
    thread."""

    rpc: str  # the method's name on its stub
    request: Any = None
    read: Callable[[Any], T] = lambda reply: reply
    timeout_s: float | None = None
    service: str = "daemon"  # or "health"
    prepare: Callable[[str], Any] | None = None


def step_call(step: int, votes: Iterable[tuple[int, Reduce, int]] = (), requests: CacheRequests | None = None,
              epoch: int | None = None) -> Call[StepResult]:
    """One scheduler iteration: -> StepResult. `epoch`: the one the
    session was attached in (`AttachReply.epoch`; None: unchecked)."""
    return Call("Step", step_request(step, votes, requests, epoch), step_result)


def outcome_call(epoch: int, step: int) -> Call[pb.OutcomeReply]:
    """How step `step` of epoch `epoch` ended on this daemon's rank:
    -> pb.OutcomeReply (a peer's scheduler asks it when its own daemon
    died before answering; `Client` does so by itself)."""
    return Call("Outcome", pb.OutcomeRequest(epoch=epoch, step=step))


def attach_call(model_id: str, geometry: KVGeometry, device_pages: int, pool_fd: int = -1,
                cuda_ipc: dict[str, Any] | None = None, placement: tuple[Topology, int] | None = None,
                regions: Sequence[Region] = (), load_signals: LoadSignals | None = None,
                cuda_events: Sequence[bytes] = (), model_dtype: str = "") -> Call[pb.AttachReply]:
    """Hand the daemon this model's device pool: -> pb.AttachReply.
    `pool_fd`: a sealed memfd pool (`DevicePool.create_sealed`), handed
    over by descriptor on the daemon's `<socket>.pools`; or `cuda_ipc`,
    one CUDA storage. `regions`: where each layer lies in it (none: one
    contiguous pool), or, with neither `pool_fd` nor `cuda_ipc`, each
    layer in its own CUDA storage (`Region.cuda_ipc`). `placement`: the
    scheduler's topology and global rank, which the daemon checks
    against its own. `load_signals`: a board where the daemon publishes
    each load's layers as they land (handed over by descriptor too), with
    `cuda_events` on CUDA hosts: an IPC event handle per slot and layer.
    `model_dtype`: the dtype the model computes in (with its weight
    quantization, if any), part of the tenant with `model_id` and the
    geometry (AttachRequest.model_dtype)."""

    attempt = secrets.randbits(63) or 1  # every retry of this attach sends it: the daemon tells it from a new one

    def request(address: str) -> pb.AttachRequest:
        ticket = hand_over(address, pool_fd) if pool_fd >= 0 else ""
        board = (hand_over(address, load_signals.fd), load_signals.slots, tuple(cuda_events)) \
            if load_signals is not None else None
        request = attach_request(model_id, geometry, device_pages, ticket, cuda_ipc, placement, regions, board,
                                 model_dtype)
        request.attempt = attempt
        return request

    return Call("Attach", read=functools.partial(attached_whole, geometry), prepare=request)


def attached_whole(geometry: KVGeometry, reply: pb.AttachReply) -> pb.AttachReply:
    """The reply, once it says the daemon took whole pages: a daemon from
    before parts beside the KV reads a geometry with parts as its KV alone
    (and would store pages without them)."""
    if geometry.beside and reply.page_bytes != geometry.page_bytes:
        raise errors.FailedPrecondition(
            f"attach: the daemon took pages of {reply.page_bytes} bytes, not the {geometry.page_bytes} of the KV "
            f"and its parts ({', '.join(geometry.part_names)}): it predates parts beside the KV; upgrade it")
    return reply


def wait_loads_call(op_ids: Iterable[int], timeout_s: float = 30.0) -> Call[None]:
    """Wait until these loads reached the device pool: -> None. The call's
    deadline is `timeout_s` plus a margin."""
    # 0 asks the daemon to wait without a limit: the client's deadline bounds it.
    deadline = timeout_s + WAIT_MARGIN_S if timeout_s > 0 else None
    return Call("WaitLoads", pb.WaitLoadsRequest(op_ids=op_ids, timeout_s=timeout_s), lambda reply: None, deadline)


def match_call(pages: Iterable[bytes], host_only: bool = False) -> Call[pb.MatchReply]:
    """Host and storage prefix hits: -> pb.MatchReply. `host_only`: the
    host pool only (agreed state, the same on every rank; no storage)."""
    return Call("Match", pb.MatchRequest(pages=pages, host_only=host_only))


def stats_call() -> Call[dict[str, int]]:
    """-> dict[str, int], the daemon's counters."""
    return Call("Stats", pb.StatsRequest(), lambda reply: dict(reply.counters))


def status_call() -> Call[pb.StatusReply]:
    """-> pb.StatusReply."""
    return Call("Status", pb.StatusRequest())


def health_call(service: str = "") -> Call[int]:
    """-> int, a `HealthCheckResponse.ServingStatus`."""
    return Call("Check", health_pb2.HealthCheckRequest(service=service), lambda reply: reply.status, service="health")
