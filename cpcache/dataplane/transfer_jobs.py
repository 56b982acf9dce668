"""What the movers move and what a move ends with: a transfer job (its
pages, in order, and the device pool bound when it was issued), its result,
and the tiers it moves between. Shared by the movers of each pair of tiers
(`device_copies.py`, `storage_copies.py`) and the dispatcher that runs them
(`movers.py`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cpcache.dataplane.copy_faults import LayerFaults
from cpcache.dataplane.pools import DevicePool, HostPool
from cpcache.dataplane.storage import PageBuffer, StorageBackend


@dataclass(frozen=True)
class TransferJob:
    """Pages to move, in order. `src` and `dst` are page indices in their
    tier, or storage keys where the tier is storage."""

    src: tuple
    dst: tuple
    job_id: int = 0
    device: DevicePool | None = None  # the device pool, bound when the job was issued
    # A load-back's slot in the device pool's load-signal board and the
    # scheduler's op id for it ((0, 0): none): its layers are published there.
    signal: tuple[int, int] = (0, 0)
    layer_faults: LayerFaults | None = None  # injected per-layer delays and failures (tests only)


@dataclass(frozen=True)
class TransferResult:
    job_id: int
    success: bool
    pages_done: int  # the longest prefix of the job's pages that completed


def prefix_done(flags: list[bool]) -> int:
    return next((i for i, ok in enumerate(flags) if not ok), len(flags))


@dataclass
class Tiers:
    """What the movers move between. `device` is only the pool that jobs
    issued without a session bind (tools and tests driving the movers
    alone); a daemon's jobs bind their session's pool."""

    host: HostPool
    device: DevicePool | None = None
    storage: StorageBackend | None = None

    def host_buffers(self, slots: Iterable[int]) -> list[PageBuffer]:
        return [PageBuffer.of_runs(self.host.page_parts(slot)) for slot in slots]
