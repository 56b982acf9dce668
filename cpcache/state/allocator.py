"""The host-page allocator: part of the replicated state."""

from __future__ import annotations

import heapq

from cpcache.errors import InvalidArgument, ResourceExhausted


class PageAllocator:
    """Host slots: free, allocated, or retiring (released by their owner but
    possibly still under I/O somewhere). Shared state: the same sequence of
    calls gives the same slots on every rank (lowest free slots first)."""

    def __init__(self, pages: int) -> None:
        self._free = list(range(pages))
        heapq.heapify(self._free)
        self._allocated: set[int] = set()
        self._retiring: set[int] = set()
        self.pages = pages

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def free_slots(self) -> tuple[int, ...]:
        return tuple(self._free)

    @property
    def allocated(self) -> frozenset[int]:
        return frozenset(self._allocated)

    @property
    def retiring(self) -> frozenset[int]:
        return frozenset(self._retiring)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise ResourceExhausted(f"host pool: {count} pages asked, {len(self._free)} of {self.pages} free")
        slots = [heapq.heappop(self._free) for _ in range(count)]
        self._allocated.update(slots)
        return slots

    def take(self, slots: list[int]) -> None:
        """Mark free `slots` allocated (a state rebuilt from kept pages)."""
        wanted = set(slots)
        missing = wanted - set(self._free)
        if missing or len(wanted) != len(slots):
            raise InvalidArgument(f"host pool: slots {sorted(missing)[:8]} are not free, or repeat")
        self._free = [s for s in self._free if s not in wanted]
        heapq.heapify(self._free)
        self._allocated.update(wanted)

    def retire(self, slots: list[int]) -> None:
        """The owner is done with `slots`; they return to the free list only
        through `reclaim`, once no rank has I/O on them."""
        unknown = [s for s in slots if s not in self._allocated]
        if unknown:
            raise InvalidArgument(f"host pool: slots {unknown[:8]} are not allocated")
        self._allocated.difference_update(slots)
        self._retiring.update(slots)

    def free(self, slots: list[int]) -> None:
        """Return slots that no rank has I/O on (e.g. evicted unreferenced pages)."""
        self.retire(slots)
        self.reclaim(slots)

    def reclaim(self, slots: list[int]) -> None:
        for slot in slots:
            if slot in self._retiring:
                self._retiring.discard(slot)
                heapq.heappush(self._free, slot)
