"""An offline model of the same cache: LRU device and host tiers of given
capacities over unlimited storage, processing requests one step at a time
with no I/O at all. The replay's hit rates should track it closely; the gap
is what timing (acks, backups, fetches in flight) costs."""

from __future__ import annotations

import collections

from cpcache.testing.sim.trace import PageHasher, Request


class LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.pages: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def prefix(self, pages: list[bytes]) -> int:
        for i, page in enumerate(pages):
            if page not in self.pages:
                return i
        return len(pages)

    def add(self, pages: list[bytes]) -> None:
        for page in pages:
            self.pages[page] = None
            self.pages.move_to_end(page)
        while len(self.pages) > self.capacity:
            self.pages.popitem(last=False)


def model_hit_rates(requests: list[Request], batches: list[list[Request]], hasher: PageHasher,
                    device_pages: int, host_pages: int, visible_after_steps: int = 2) -> dict[str, float]:
    """Pages a step computes reach host and storage `visible_after_steps`
    steps later (a write-through is acknowledged in the next round); on the
    device they are there at once."""
    device, host = LRU(device_pages), LRU(host_pages)
    storage: set[bytes] = set()
    landing: collections.deque[list[bytes]] = collections.deque([[] for _ in range(visible_after_steps)])
    hits: collections.Counter[str] = collections.Counter()
    total = 0
    for batch in batches:
        arriving: list[bytes] = []
        admitted = []
        for request in batch:  # a step admits its requests against the same state
            pages = hasher.pages(request)
            total += len(pages)
            d = device.prefix(pages)
            h = host.prefix(pages[d:])
            s = 0
            for page in pages[d + h :]:
                if page not in storage:
                    break
                s += 1
            hits["device"] += d
            hits["host"] += h
            hits["storage"] += s
            admitted.append((pages, d, h, s))
        for pages, d, h, s in admitted:
            device.add(pages)
            host.add(pages[d : d + h + s])
            arriving += pages[d + h + s :]
        landing.append(arriving)
        ready = landing.popleft()
        host.add(ready)
        storage.update(ready)
    t = max(1, total)
    rates = {k: hits[k] / t for k in ("device", "host", "storage")}
    rates["total"] = sum(rates.values())
    return rates
