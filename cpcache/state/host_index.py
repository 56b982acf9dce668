"""The host-page index: which page hashes are resident in which host slots.

Shared state: it changes only through scheduler calls and agreed results, so
it is identical on every rank. Pages form prefix chains (each page's key
hashes its predecessor's), so eviction takes unreferenced *leaves* only, the
least recently used first; "recently" is measured in scheduler steps, never
in local time, and ties break by hash.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container, ItemsView
from dataclasses import dataclass


@dataclass(slots=True)
class Entry:
    slot: int
    parent: bytes | None
    children: int = 0
    refs: int = 0  # operations currently reading this page (loads, backups)
    last_used: int = 0  # step of the last use
    hits: int = 0  # times matched by a load (write_through_selective)
    backed_up: bool = False
    io_suspect: bool = False  # a write from it timed out somewhere and may still be running
    held: int = 0  # ended prefetches keeping it for their request's load (`ops.prefetch_holds`)
    prefetched: bool = False  # brought by a prefetch and not loaded since


class HostIndex:
    def __init__(self, track_unbacked: bool = False) -> None:
        """`track_unbacked`: keep the pages not backed up in recency order
        too (`least_recent_unbacked`), for a policy that backs pages up
        before it may evict them."""
        self._entries: dict[bytes, Entry] = {}
        # parent hash -> resident pages that follow it while it is not
        # resident itself: its children once it enters (a chain's pages may
        # enter in any order: each write is acknowledged on its own).
        self._orphans: dict[bytes, int] = {}
        self._leaves: list[tuple[int, bytes]] = []  # lazy heap of (last_used, hash)
        # Lazy heap of (last_used, hash) holding every page not backed up
        # (None: not tracked); stale items are dropped as they surface.
        self._unbacked: list[tuple[int, bytes]] | None = [] if track_unbacked else None
        # page -> resident, for pages that entered or left since the last
        # `take_changes`: what schedulers are told, so that they can answer
        # host matches from agreed state without asking the daemon.
        self._changes: dict[bytes, bool] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, page: bytes) -> bool:
        return page in self._entries

    def resident(self) -> Container[bytes]:
        """The resident pages, for membership tests in loops over many pages
        (read-only: changes go through the methods)."""
        return self._entries.keys()

    def get(self, page: bytes) -> Entry | None:
        return self._entries.get(page)

    def __getitem__(self, page: bytes) -> Entry:
        """The entry of a page known to be resident (KeyError otherwise)."""
        return self._entries[page]

    def prefix(self, pages: list[bytes]) -> int:
        """How many of `pages`, from the first, are resident."""
        for i, page in enumerate(pages):
            if page not in self._entries:
                return i
        return len(pages)

    def insert(self, pages: list[bytes], slots: list[int], parent: bytes | None, step: int) -> None:
        """Insert a chain `pages` whose first page follows `parent`."""
        entries, changes, orphans = self._entries, self._changes, self._orphans
        for page, slot in zip(pages, slots):
            if parent is not None:
                if (parent_entry := entries.get(parent)) is not None:
                    parent_entry.children += 1
                else:
                    orphans[parent] = orphans.get(parent, 0) + 1
            entry = entries[page] = Entry(slot, parent, 0, 0, step)
            waiting = orphans.pop(page, 0)
            if waiting:  # pages that follow it entered first
                entry.children = waiting - self._cut_loop(page)
            changes[page] = True
            parent = page
        if pages:
            self._push(step, pages[-1])
        if self._unbacked is not None:
            for page in pages:
                self._push_unbacked(step, page)

    def _cut_loop(self, page: bytes) -> int:
        """1 if following parents from `page`, just entered, leads back to it,
        0 if not. A real chain never loops: a page's hash covers its
        parent's. Hashes a scheduler made up may loop, and a loop would pin
        every page on it, each a parent of the next. So the loop's last link
        (the page whose parent is `page`) is cut: that page has no parent."""
        entries = self._entries
        node = entries[page]
        for _ in range(len(entries)):
            up = node.parent
            if up is None or (above := entries.get(up)) is None:
                return 0
            if up == page:
                node.parent = None
                return 1
            node = above
        return 0

    def touch(self, pages: list[bytes], step: int, hit: bool = False) -> None:
        for page in pages:
            entry = self._entries[page]
            entry.last_used = step
            entry.hits += hit
            if not entry.children:  # a leaf's heap item must carry its new stamp
                self._push(step, page)
            if self._unbacked is not None and not entry.backed_up:
                self._push_unbacked(step, page)

    def mark_backed_up(self, page: bytes, backed_up: bool) -> None:
        entry = self._entries[page]
        if self._unbacked is not None and entry.backed_up and not backed_up:
            self._push_unbacked(entry.last_used, page)
        entry.backed_up = backed_up

    def _push_unbacked(self, step: int, page: bytes) -> None:
        assert self._unbacked is not None
        heapq.heappush(self._unbacked, (step, page))
        if len(self._unbacked) > 2 * len(self._entries) + 64:
            self._unbacked = [(e.last_used, p) for p, e in self._entries.items() if not e.backed_up]
            heapq.heapify(self._unbacked)

    def least_recent_unbacked(self, count: int) -> list[bytes]:
        """Up to `count` unreferenced pages not backed up, least recently
        used first (ties by hash), leaves or not. Work is proportional to
        the pages looked at, not to the index."""
        assert self._unbacked is not None, "the index does not track pages not backed up"
        heap, entries = self._unbacked, self._entries
        found: list[bytes] = []
        looked: dict[bytes, int] = {}  # page -> stamp, each page once
        while len(found) < count and heap:
            stamp, page = heapq.heappop(heap)
            entry = entries.get(page)
            if entry is None or entry.last_used != stamp or entry.backed_up or page in looked:
                continue  # stale: a fresher item, or none, stands for it
            looked[page] = stamp
            if not entry.refs:
                found.append(page)
        for page, stamp in looked.items():  # still not backed up: they stay
            heapq.heappush(heap, (stamp, page))
        return found

    def ref(self, pages: list[bytes], delta: int) -> None:
        for page in pages:
            self._entries[page].refs += delta

    def _push(self, step: int, page: bytes) -> None:
        heapq.heappush(self._leaves, (step, page))
        if len(self._leaves) > 2 * len(self._entries) + 64:
            self._compact()

    def _compact(self) -> None:
        """Rebuild the heap from the current leaves: stale items (a page
        touched again, evicted, or no longer a leaf) would otherwise pile up.
        The order it yields is the same: items are compared by (stamp, hash)."""
        self._leaves = [(e.last_used, p) for p, e in self._entries.items() if not e.children]
        heapq.heapify(self._leaves)

    def evict(self, count: int, skip: Callable[[bytes, Entry], bool] = lambda page, entry: False,
              frees: Callable[[Entry], bool] = lambda entry: True,
              all_or_nothing: bool = False) -> list[tuple[bytes, Entry]]:
        """Remove up to `count` unreferenced leaves, least recently used first
        (a removed leaf may expose its parent as the next leaf). `skip` keeps
        a page in place (e.g. not yet written back). Only pages for which
        `frees` holds count toward `count` (the others leave no free slot).
        With `all_or_nothing`, remove nothing unless `count` can be reached.

        Work is proportional to the leaves looked at, not to the index: the
        choice is made on the heap itself, and undone if it falls short."""
        evicted: list[tuple[bytes, Entry]] = []
        kept: list[tuple[int, bytes]] = []  # looked at and staying
        exposed: list[tuple[int, bytes]] = []  # parents left without children by this call
        lost_children: dict[bytes, int] = {}
        gone: set[bytes] = set()
        freed = 0
        leaves, entries, pop, push = self._leaves, self._entries, heapq.heappop, heapq.heappush
        # A parent exposed by this call that comes before every heap item is
        # taken next without a trip through the heap: a chain's pages leave
        # one after another.
        following: tuple[int, bytes] | None = None
        while freed < count:
            if following is not None:
                (stamp, page), following = following, None
            elif exposed and (not leaves or exposed[0] < leaves[0]):
                stamp, page = pop(exposed)
            elif leaves:
                stamp, page = pop(leaves)
            else:
                break
            entry = entries.get(page)
            if entry is None or entry.last_used != stamp or page in gone:
                continue  # stale: dropped for good
            if entry.children and entry.children - lost_children.get(page, 0):
                continue  # not a leaf: dropped too (pushed again once its last child goes)
            if entry.refs or skip(page, entry):
                kept.append((stamp, page))
                continue
            evicted.append((page, entry))
            freed += bool(frees(entry))
            gone.add(page)
            parent_page = entry.parent
            if parent_page is None:
                continue
            lost = lost_children[parent_page] = lost_children.get(parent_page, 0) + 1
            parent = entries.get(parent_page)
            if parent is not None and parent.children == lost:
                item = (parent.last_used, parent_page)
                if (not leaves or item < leaves[0]) and (not exposed or item < exposed[0]):
                    following = item
                else:
                    push(exposed, item)
        if following is not None:
            exposed.append(following)  # not looked at: back to the heap with the others
        if all_or_nothing and freed < count:  # undo: everything looked at stays
            kept += [(entry.last_used, page) for page, entry in evicted]
            evicted, exposed, lost_children = [], [], {}
        for parent_page, lost in lost_children.items():
            if (parent_entry := self._entries.get(parent_page)) is not None:
                parent_entry.children -= lost
            elif (left := self._orphans.pop(parent_page, 0) - lost) > 0:
                self._orphans[parent_page] = left
        for page, _ in evicted:
            del self._entries[page]
            self._changes[page] = False
        for item in (*kept, *exposed):
            heapq.heappush(self._leaves, item)
        return evicted

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """Pages that entered and pages that left the index since the last
        call (net: a page that left and came back entered), in hash order."""
        changes, self._changes = self._changes, {}
        entered = sorted(p for p, resident in changes.items() if resident)
        left = sorted(p for p, resident in changes.items() if not resident)
        return entered, left

    def items(self) -> ItemsView[bytes, Entry]:
        return self._entries.items()
