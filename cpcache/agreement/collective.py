"""The daemons' own gloo world: rendezvous store and the process groups a
rank reduces over.

Groups are built directly as `ProcessGroupGloo` objects over a `PrefixStore`,
so they never touch (or need) torch's default process group, and keys are
namespaced by deployment and epoch so two deployments or two restarts of one
never meet in the store.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch.distributed import AllreduceOptions, AllToAllOptions, PrefixStore, ProcessGroupGloo, ReduceOp, TCPStore

from cpcache.errors import InvalidArgument
from cpcache.topology import MODES, Group, Topology


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: a TCPStore and a key namespace."""

    host: str
    port: int
    deployment: str = "cpcache"
    epoch: int = 0
    timeout_s: float = 60.0

    @property
    def namespace(self) -> str:
        return f"cpcache/{self.deployment}/epoch{self.epoch}"

    def connect(self, timeout_s: float | None = None) -> TCPStore:
        """A client connection to the store (one per thread that uses it)."""
        return TCPStore(
            self.host,
            self.port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s or self.timeout_s),
            wait_for_workers=False,
        )


def host_store(host: str = "127.0.0.1", port: int = 0) -> TCPStore:
    """Serve a rendezvous store on `host` only (port 0: any free port, read
    back `.port`). TCPStore itself would listen on every interface whatever
    host it is given, so the socket is bound here and handed over."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise InvalidArgument(f"setting rendezvous: cannot resolve {host!r}: {exc}") from None
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(1024)
    except OSError as exc:
        listener.close()
        raise InvalidArgument(f"setting rendezvous: cannot listen on {host}:{port}: {exc}") from None
    bound = listener.getsockname()[1]
    # The store owns the descriptor from here (it closes it when it goes).
    return TCPStore(host, bound, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach())


class Reducer(Protocol):
    """Reduces an int64 vector with MIN over the whole agreement domain."""

    def min_inplace(self, vector: np.ndarray) -> None: ...

    def close(self) -> None: ...


def gloo_group(
    store: TCPStore, rdzv: Rendezvous, group: Group, rank: int, timeout_s: float, bind_host: str
) -> ProcessGroupGloo:
    """Join one group. Joining waits up to the rendezvous timeout (peers may
    still be starting); collectives then wait at most `timeout_s`."""
    key = f"{rdzv.namespace}/{group.name}/" + "-".join(map(str, group.ranks)) + "/"
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the binding's class, absent from torch's stub
    options._timeout = datetime.timedelta(seconds=rdzv.timeout_s)
    options._devices = [ProcessGroupGloo.create_device(hostname=bind_host)]
    options._threads = 1  # rounds run one at a time: a second worker thread only adds wake-ups
    pg = ProcessGroupGloo(PrefixStore(key, store), group.index(rank), group.size, options)
    pg.set_timeout(datetime.timedelta(seconds=timeout_s))
    return pg


_MIN = AllreduceOptions()
_MIN.reduceOp = ReduceOp(ReduceOp.MIN)
_ALLTOALL = AllToAllOptions()

# Up to this group size a reduction is one all-to-all exchange followed by a
# local MIN: every message travels in one hop, where gloo's ring all-reduce
# needs 2 * (size - 1) dependent hops (measured here on 4 ranks: about 1 ms
# against 4.5 ms for a 69-element vector). Beyond it the ring's smaller
# volume wins.
ALLTOALL_MAX_GROUP = 32


class GroupReducer:
    """Sequential MIN reductions over a list of groups. One group covering
    the domain is `domain` mode; attn_cp then attn_tp (then pp) is `grid`
    mode; an empty list is a domain of one rank. MIN over integers is exact,
    commutative and associative, so every rank computes the same result
    whichever way the values travel."""

    def __init__(self, groups: list[ProcessGroupGloo]) -> None:
        self._groups = groups

    def min_inplace(self, vector: np.ndarray) -> None:
        tensor = torch.from_numpy(vector)
        for group in self._groups:
            size = group.size()
            if size <= ALLTOALL_MAX_GROUP:
                outgoing = tensor.repeat(size)
                incoming = torch.empty_like(outgoing)
                splits = [len(vector)] * size
                # Backend's collectives are bound at runtime but absent from torch's stub.
                group.alltoall_base(incoming, outgoing, splits, splits, _ALLTOALL).wait()  # type: ignore[attr-defined]
                np.min(incoming.numpy().reshape(size, len(vector)), axis=0, out=vector)
            else:
                group.allreduce([tensor], _MIN).wait()  # type: ignore[attr-defined]

    def close(self) -> None:
        for group in self._groups:
            try:
                group.shutdown()
            except RuntimeError:
                pass  # already broken by a lost peer; nothing left to release
        self._groups = []


def confirmation_reducer(store: TCPStore, rdzv: Rendezvous, domain: Group, rank: int, timeout_s: float,
                         bind_host: str = "127.0.0.1") -> GroupReducer:
    """A reducer over the whole domain on a group of its own, for rounds that
    are not steps (an Attach's confirmation): they never interleave with the
    steps' rounds, whatever each rank's timing."""
    if domain.size <= 1:
        return GroupReducer([])
    return GroupReducer([gloo_group(store, rdzv, Group("confirm", domain.ranks), rank, timeout_s, bind_host)])


def reducer_groups(topology: Topology, rank: int, mode: str) -> list[Group]:
    if mode == "domain":
        domain = topology.domain(rank)
        return [domain] if domain.size > 1 else []
    if mode == "grid":
        return topology.grid_groups(rank)
    raise InvalidArgument(f"mode must be one of {', '.join(MODES)}, got {mode!r}")


def build_reducer(
    store: TCPStore,
    rdzv: Rendezvous,
    topology: Topology,
    rank: int,
    mode: str,
    timeout_s: float,
    bind_host: str = "127.0.0.1",
) -> GroupReducer:
    """Join this rank's groups; blocks until every member has joined."""
    groups = reducer_groups(topology, rank, mode)
    return GroupReducer([gloo_group(store, rdzv, g, rank, timeout_s, bind_host) for g in groups])
