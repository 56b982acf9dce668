"""A replicated scheduler, one per rank, driving its own daemon.

Every rank runs this same deterministic logic over the same requests; its
only inputs beyond the trace are the daemon's replies, which are agreed. It
keeps a device pool of its own (LRU over device pages), writes KV content
derived from each page's storage key as a forward pass would, and checks
every page that a load-back brings to the device: a wrong byte anywhere is
counted as a corrupt load.
"""

from __future__ import annotations

import collections
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cpcache.client import AsyncClient, Ops, StepResult
from cpcache.dataplane.pools import DevicePool
from cpcache.geometry import KVGeometry
from cpcache.keys import ShardingSpec
from cpcache.testing.sim.trace import PageHasher, Request

# A step's operations being gathered, by `Ops` field name (tuples as `Ops` takes them).
StepOpLists = dict[str, list[Any]]


def page_content(storage_key: str, nbytes: int) -> np.ndarray:
    """The bytes a forward pass writes for a page: a function of its storage
    key (so CP ranks that share a page write the same bytes)."""
    seed = hashlib.blake2b(storage_key.encode(), digest_size=64).digest()
    reps = -(-nbytes // len(seed))
    return np.frombuffer(seed * reps, dtype=np.uint8)[:nbytes]


@dataclass
class Tally:
    requests: int = 0
    tokens: int = 0
    device_hit: int = 0
    host_hit: int = 0
    storage_hit: int = 0
    computed: int = 0
    corrupt_loads: int = 0
    loaded_pages: int = 0
    prefetches: int = 0
    prefetch_revoked: int = 0
    written_pages: int = 0
    skipped_writes: int = 0

    def hit_rates(self) -> dict[str, float]:
        t = max(1, self.tokens)
        return {
            "device": self.device_hit / t,
            "host": self.host_hit / t,
            "storage": self.storage_hit / t,
            "total": (self.device_hit + self.host_hit + self.storage_hit) / t,
        }


@dataclass
class Active:
    """A request between its arrival and its forward pass."""

    request: Request
    pages: list[bytes]
    device: list[int] = field(default_factory=list)  # device page of each page known so far
    prefetch: int | None = None  # open prefetch op id
    loads: set[int] = field(default_factory=set)  # open load op ids
    verify: list[tuple[int, int]] = field(default_factory=list)  # (page index, device page) to check


class SimScheduler:
    def __init__(self, client: AsyncClient, device: DevicePool, hasher: PageHasher, sharding: ShardingSpec,
                 device_pages: int) -> None:
        self.client = client
        self.device = device
        self.geometry: KVGeometry = device.geometry
        self.hasher = hasher
        self.sharding = sharding  # the daemon's own: the same storage keys
        self.lru: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # page -> device page
        self.free = list(range(device_pages - 1, -1, -1))
        self.pinned: collections.Counter[int] = collections.Counter()
        self.active: list[Active] = []
        self.tally = Tally()
        self.step_no = 0
        self.next_op = 1
        self.log: list[bytes] = []  # every reply, as received: the decision log
        self.round_latencies: list[float] = []  # each Step call, as this scheduler saw it
        self.pending: Ops = Ops()
        self._waiting_prefetch: dict[int, Active] = {}
        self._waiting_load: dict[int, Active] = {}
        self._writing: dict[int, list[int]] = {}  # write op -> device pages it reads
        self.resumed_pages = 0  # host pages its attach found from an earlier session

    # -- device pool --------------------------------------------------------------

    def _key(self, page: bytes) -> str:
        return self.sharding.storage_key(page.hex())

    def _allocate(self, count: int) -> list[int] | None:
        while len(self.free) < count:
            victim = next((p for p, d in self.lru.items() if not self.pinned[d]), None)
            if victim is None:
                return None
            self.free.append(self.lru.pop(victim))
        return [self.free.pop() for _ in range(count)]

    def _read_page(self, device_page: int) -> np.ndarray:
        view = self.device.page_view(device_page)  # a page is strided across layers
        return view.contiguous().view(-1).view(torch.uint8).numpy()

    def _write_page(self, device_page: int, content: np.ndarray) -> None:
        view = self.device.page_view(device_page)
        view.copy_(torch.from_numpy(content.copy()).view(view.dtype).view(view.shape))

    def _op(self) -> int:
        self.next_op += 1
        return self.next_op

    # -- one scheduler iteration -------------------------------------------------------

    async def iterate(self, arrivals: list[Request]) -> StepResult:
        pending = self.take_pending()
        ops: StepOpLists = {"prefetches": [], "polls": [], "writes": list(pending.writes), "loads": list(pending.loads),
               "revokes": []}
        ops["polls"] = list(self._waiting_prefetch)  # opened in earlier steps
        for request in arrivals:
            await self._admit(request, ops)
        self.step_no += 1
        started = time.perf_counter()
        # A full host pool is not an error: such writes come back in write_failures.
        reply = await self.client.step(self.step_no, ops=Ops(**{k: tuple(v) for k, v in ops.items()}))
        self.round_latencies.append(time.perf_counter() - started)
        self.log.append(reply.wire)
        await self._absorb(reply)
        return reply

    async def _admit(self, request: Request, ops: StepOpLists) -> None:
        pages = self.hasher.pages(request)
        page_tokens = self.geometry.page_size
        self.tally.requests += 1
        self.tally.tokens += len(pages) * page_tokens
        active = Active(request, pages)
        on_device = 0
        for page in pages:
            if page not in self.lru:
                break
            self.lru.move_to_end(page)
            active.device.append(self.lru[page])
            on_device += 1
        self.tally.device_hit += on_device * page_tokens
        for d in active.device:
            self.pinned[d] += 1
        rest = pages[on_device:]
        host = (await self.client.match(rest)).host_pages if rest else 0
        if host and not self._load(active, on_device, host, ops):
            host = 0  # no device room now: fetch them like the rest (a later load must not assume them)
        self.tally.host_hit += host * page_tokens
        remaining = pages[on_device + host :]
        if remaining:
            op_id = self._op()
            parent = pages[on_device + host - 1] if on_device + host else b""
            ops["prefetches"].append((op_id, remaining, len(remaining) * page_tokens, parent))
            active.prefetch = op_id
            self._waiting_prefetch[op_id] = active
            self.tally.prefetches += 1
        self.active.append(active)

    def _load(self, active: Active, first: int, count: int, ops: StepOpLists) -> bool:
        targets = self._allocate(count)
        if targets is None:
            return False
        op_id = self._op()
        ops["loads"].append((op_id, active.pages[first : first + count], targets))
        for i, d in enumerate(targets):
            self.pinned[d] += 1
            active.verify.append((first + i, d))
        active.device += targets
        active.loads.add(op_id)
        self._waiting_load[op_id] = active
        return True

    async def _absorb(self, reply: StepResult) -> None:
        follow: StepOpLists = {"loads": []}
        for op_id, pages in reply.prefetch_done.items():
            active = self._waiting_prefetch.pop(op_id, None)
            if active is None:
                continue
            active.prefetch = None
            if pages:
                first = len(active.device)
                if self._load(active, first, pages, follow):
                    self.tally.storage_hit += pages * self.geometry.page_size
        for op_id in reply.prefetch_revoked:
            active = self._waiting_prefetch.pop(op_id, None)
            if active is not None:
                active.prefetch = None
                self.tally.prefetch_revoked += 1
        for op_id in reply.write_acks:
            for d in self._writing.pop(op_id, ()):
                self.pinned[d] -= 1
        for op_id in reply.write_failures:  # a full host pool, or a failed copy: alike on every rank
            targets = self._writing.pop(op_id, ())
            self.tally.skipped_writes += len(targets)
            for d in targets:
                self.pinned[d] -= 1
        for op_id in reply.loads:
            active = self._waiting_load.pop(op_id, None)
            if active is not None:
                active.loads.discard(op_id)
        if follow["loads"]:
            self.pending = Ops(loads=tuple(follow["loads"]))
        await self._finish_ready()

    async def _finish_ready(self) -> None:
        """Requests with nothing left to wait for run their forward pass."""
        still = []
        for active in self.active:
            if active.prefetch is not None or active.loads:
                still.append(active)
                continue
            await self._forward(active)
        self.active = still

    async def _forward(self, active: Active) -> None:
        for index, device_page in active.verify:
            expected = page_content(self._key(active.pages[index]), self.geometry.page_bytes)
            if not np.array_equal(self._read_page(device_page), expected):
                self.tally.corrupt_loads += 1
            self.tally.loaded_pages += 1
        known = len(active.device)
        missing = active.pages[known:]
        targets = self._allocate(len(missing)) if missing else []
        if targets is None:
            targets = []
            missing = []
        for page, d in zip(missing, targets):
            self._write_page(d, page_content(self._key(page), self.geometry.page_bytes))
        self.tally.computed += (len(active.pages) - known) * self.geometry.page_size
        if missing:
            parent = active.pages[known - 1] if known else b""
            op_id = self._op()
            # The daemon copies these device pages later: keep them until acked.
            self._writing[op_id] = targets
            for d in targets:
                self.pinned[d] += 1
            self.pending = Ops(
                loads=self.pending.loads,
                writes=self.pending.writes + ((op_id, missing, targets, parent),),
            )
            self.tally.written_pages += len(missing)
        for d in active.device:
            self.pinned[d] -= 1
        for page, d in zip(active.pages, active.device + targets):
            if page in self.lru and self.lru[page] != d:
                self.free.append(d)  # another request brought this page meanwhile
                continue
            self.lru[page] = d
            self.lru.move_to_end(page)

    def take_pending(self) -> Ops:
        ops, self.pending = self.pending, Ops()
        return ops
