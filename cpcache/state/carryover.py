"""What a domain keeps of its host tier when it re-forms in a new epoch.

Between epochs the replicated state has no agreed history to continue from:
a rank may have applied a round or two more than another, a restarted daemon
has nothing. So each rank offers the pages it holds whole (after its own I/O
has drained), every rank takes the same offers from the rendezvous store, and
each keeps exactly the pages every rank offered in the same slot under the
same parent, whole chains only. Every rank computes the same result from the
same offers, so the new epoch starts from one state everywhere: at worst
empty (a restarted daemon offers nothing), never different. Open operations
do not carry over: their schedulers are gone or told so.

A rank whose I/O has not drained offers no pages and names the host slots
that I/O still touches: every rank takes the union out of the new epoch's
free slots (retired, back only through an agreed reclaim once no rank has
I/O on them, docs/design.md rule 5), so a late write never lands in a reused slot.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from cpcache.hashing import hash62
from cpcache.state.allocator import PageAllocator
from cpcache.state.host_index import HostIndex

_ENTRY = struct.Struct("<32s32sI?")  # page, parent (zeros: none), slot, backed up
_COUNT = struct.Struct("<I")
_SLOT = struct.Struct("<I")
_NONE = bytes(32)


@dataclass(frozen=True)
class KeptPage:
    page: bytes
    parent: bytes | None
    slot: int
    backed_up: bool


def offer(index: HostIndex) -> list[KeptPage]:
    """The pages this rank holds whole: resident, and not under a write that
    may still be running somewhere."""
    return sorted((KeptPage(page, entry.parent, entry.slot, entry.backed_up)
                   for page, entry in index.items() if not entry.io_suspect), key=lambda k: k.page)


@dataclass(frozen=True)
class Offer:
    pages: list[KeptPage]
    busy: list[int]  # host slots this rank's I/O still touches


def digest(index: HostIndex) -> int:
    """What a kept index would offer, as one number (ranks attaching to
    kept caches agree on it)."""
    return hash62(encode(offer(index)))


def encode(pages: Sequence[KeptPage], busy: Sequence[int] = ()) -> bytes:
    head = _COUNT.pack(len(busy)) + b"".join(_SLOT.pack(slot) for slot in busy)
    return head + b"".join(_ENTRY.pack(k.page.rjust(32, b"\0"), (k.parent or _NONE).rjust(32, b"\0"), k.slot,
                                       k.backed_up) for k in pages)


def decode(data: bytes) -> Offer:
    if not data:
        return Offer([], [])  # a rank with nothing to offer
    (count,) = _COUNT.unpack_from(data)
    start = _COUNT.size + count * _SLOT.size
    busy = [slot for (slot,) in _SLOT.iter_unpack(data[_COUNT.size:start])]
    body = data[start:]
    if len(body) % _ENTRY.size:
        raise ValueError(f"a page offer of {len(body)} bytes is not a whole number of entries")
    pages = [KeptPage(page, None if parent == _NONE else parent, slot, backed_up)
             for page, parent, slot, backed_up in _ENTRY.iter_unpack(body)]
    return Offer(pages, busy)


def busy_slots(offers: Sequence[Offer], kept: Sequence[KeptPage]) -> list[int]:
    """Slots some rank's I/O still touches, apart from kept pages' (read in
    place, unchanged)."""
    kept_slots = {k.slot for k in kept}
    return sorted({slot for o in offers for slot in o.busy} - kept_slots)


def common(offers: Sequence[Sequence[KeptPage]]) -> list[KeptPage]:
    """The pages every rank offered alike, whole chains only, parents first."""
    if not offers:
        return []
    by_rank = [{k.page: k for k in offer} for offer in offers]
    agreed: dict[bytes, KeptPage] = {}
    for page, kept in by_rank[0].items():
        others = [index.get(page) for index in by_rank[1:]]
        if all(o is not None and (o.slot, o.parent) == (kept.slot, kept.parent) for o in others):
            backed = kept.backed_up and all(o is not None and o.backed_up for o in others)
            agreed[page] = KeptPage(page, kept.parent, kept.slot, backed)
    # A page whose parent is not kept is unreachable by any prefix: drop it
    # (and so its own descendants).
    whole: dict[bytes, bool] = {}

    def reachable(page: bytes) -> bool:
        chain = []
        while page not in whole:
            kept = agreed.get(page)
            if kept is None:
                whole[page] = False
                break
            if kept.parent is None:
                whole[page] = True
                break
            chain.append(page)
            page = kept.parent
        verdict = whole[page]
        for p in chain:
            whole[p] = verdict
        return verdict

    return _parents_first([agreed[page] for page in sorted(agreed) if reachable(page)])


def _parents_first(pages: list[KeptPage]) -> list[KeptPage]:
    by_page = {k.page: k for k in pages}
    depth: dict[bytes, int] = {}
    for k in pages:
        chain, page = [], k.page
        while page not in depth:
            parent = by_page[page].parent
            if parent is None:
                depth[page] = 0
                break
            chain.append(page)
            page = parent
        d = depth[page]
        for p in reversed(chain):
            d += 1
            depth[p] = d
    return sorted(pages, key=lambda k: (depth[k.page], k.page))


def restore(pages: Sequence[KeptPage], index: HostIndex, allocator: PageAllocator) -> None:
    """Fill a fresh index and allocator with the kept pages (parents first).
    Their last use is step 0: older than anything the new epoch touches."""
    allocator.take([k.slot for k in pages])
    for k in pages:
        index.insert([k.page], [k.slot], k.parent, 0)
        if k.backed_up:
            index[k.page].backed_up = True
