"""A replicated scheduler, one per rank, driving its own daemon.

Every rank runs this same deterministic logic over the same requests; its
only inputs beyond the trace are the daemon's replies, which are agreed. It
keeps a device pool of its own (LRU over device pages), writes KV content
derived from each page's storage key as a forward pass would, and checks
every page that a load-back brings to the device: a wrong byte anywhere is
counted as a corrupt load. Its cache operations go through the one
scheduler-side session (`cpcache.client.SchedulerSession`), which it sends
over its asyncio client itself.
"""

from __future__ import annotations

import collections
import functools
import time
from dataclasses import dataclass, field

import numpy as np

from cpcache.client import AsyncClient, DecisionLog, SchedulerSession, StepResult
from cpcache.dataplane.pools import DevicePool
from cpcache.geometry import KVGeometry
from cpcache.keys import ShardingSpec
from cpcache.testing.sim.pages import page_content, read_page, write_page
from cpcache.testing.sim.trace import PageHasher, Request


@dataclass
class Workload:
    """What the requests found and what the forward passes checked; the cache
    operations' outcomes are the session's `Tally`."""

    requests: int = 0
    tokens: int = 0
    device_hit: int = 0
    host_hit: int = 0
    storage_hit: int = 0
    computed: int = 0
    corrupt_loads: int = 0
    loaded_pages: int = 0  # loaded pages checked by a forward pass

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
        self.workload = Workload()
        self.log = DecisionLog(whole_replies=True)  # every reply as received: ranks compare them byte for byte
        self.session = SchedulerSession(decisions=self.log)
        self.round_latencies: list[float] = []  # each Step call, as this scheduler saw it
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

    def _unpin(self, device_pages: list[int]) -> None:
        for d in device_pages:
            self.pinned[d] -= 1

    def _written(self, device_pages: list[int], _stored: bool) -> None:
        self._unpin(device_pages)  # decided: the daemon reads them no more

    # -- one scheduler iteration -------------------------------------------------------

    async def iterate(self, arrivals: list[Request]) -> StepResult:
        session = self.session
        for op in session.open_prefetches():  # opened in earlier steps
            session.poll(op)
        for request in arrivals:
            await self._admit(request)
        step, ops = session.next_step()
        started = time.perf_counter()
        # A full host pool is not an error: such writes come back in write_failures.
        reply = await self.client.step(step, ops=ops)
        self.round_latencies.append(time.perf_counter() - started)
        session.follow(reply)  # prefetches ended here queue their loads for the next step
        self._finish_ready()
        return reply

    async def _admit(self, request: Request) -> None:
        pages = self.hasher.pages(request)
        page_tokens = self.geometry.page_size
        self.workload.requests += 1
        self.workload.tokens += len(pages) * page_tokens
        active = Active(request, pages)
        on_device = 0
        for page in pages:
            if page not in self.lru:
                break
            self.lru.move_to_end(page)
            active.device.append(self.lru[page])
            on_device += 1
        self.workload.device_hit += on_device * page_tokens
        for d in active.device:
            self.pinned[d] += 1
        rest = pages[on_device:]
        host = (await self.client.match(rest)).host_pages if rest else 0
        if host and not self._load(active, on_device, host):
            host = 0  # no device room now: fetch them like the rest (a later load must not assume them)
        self.workload.host_hit += host * page_tokens
        remaining = pages[on_device + host :]
        if remaining:
            parent = pages[on_device + host - 1] if on_device + host else None
            active.prefetch = self.session.prefetch(remaining, len(remaining) * page_tokens, parent,
                                                    done=lambda brought: self._prefetched(active, brought))
        self.active.append(active)

    def _load(self, active: Active, first: int, count: int) -> bool:
        targets = self._allocate(count)
        if targets is None:
            return False

        def landed(ok: bool) -> None:
            if ok:  # a failed load keeps its request waiting
                active.loads.discard(op)

        op = self.session.load(active.pages[first : first + count], targets, done=landed)
        for i, d in enumerate(targets):
            self.pinned[d] += 1
            active.verify.append((first + i, d))
        active.device += targets
        active.loads.add(op)
        return True

    def _prefetched(self, active: Active, pages: int) -> None:
        """A prefetch ended (0 pages: revoked): load what it brought."""
        active.prefetch = None
        if pages and self._load(active, len(active.device), pages):
            self.workload.storage_hit += pages * self.geometry.page_size

    def _finish_ready(self) -> None:
        """Requests with nothing left to wait for run their forward pass."""
        still = []
        for active in self.active:
            if active.prefetch is not None or active.loads:
                still.append(active)
                continue
            self._forward(active)
        self.active = still

    def _forward(self, active: Active) -> None:
        for index, device_page in active.verify:
            expected = page_content(self._key(active.pages[index]), self.geometry.page_bytes)
            if not np.array_equal(read_page(self.device, device_page), expected):
                self.workload.corrupt_loads += 1
            self.workload.loaded_pages += 1
        known = len(active.device)
        missing = active.pages[known:]
        targets = self._allocate(len(missing)) if missing else []
        if targets is None:
            targets = []
            missing = []
        for page, d in zip(missing, targets):
            write_page(self.device, d, page_content(self._key(page), self.geometry.page_bytes))
        self.workload.computed += (len(active.pages) - known) * self.geometry.page_size
        if missing:
            parent = active.pages[known - 1] if known else None
            # The daemon copies these device pages later: keep them until decided.
            for d in targets:
                self.pinned[d] += 1
            self.session.write_through(missing, targets, parent, done=functools.partial(self._written, targets))
        self._unpin(active.device)
        for page, d in zip(active.pages, active.device + targets):
            if page in self.lru and self.lru[page] != d:
                self.free.append(d)  # another request brought this page meanwhile
                continue
            self.lru[page] = d
            self.lru.move_to_end(page)
