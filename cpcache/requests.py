"""What a scheduler step carries, and the checks that need no shared state.

One vocabulary for both ends of the wire: the client builds these requests
and the daemon reads them back into the same types before its state machine
sees them.

Every id is checked to lie in [0, 2**63), every device page to lie inside the
attached pool, every page count to be bounded, before anything reaches the
state machine.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from cpcache.errors import InvalidArgument
from cpcache.hashing import hash62
from cpcache.values import check_id

MAX_PAGES_PER_OP = 1 << 18  # a 256k-token prompt at page size 1
MAX_REQUESTS_PER_STEP = 4096
PAGE_HASH_BYTES = 32


def check_page_hash(page: bytes, what: str) -> None:
    """Refuse anything but a page hash (a 32-byte sha256 digest) as `what`."""
    if len(page) != PAGE_HASH_BYTES:
        raise InvalidArgument(f"{what} must be a {PAGE_HASH_BYTES}-byte page hash, got {len(page)} bytes")


def check_page_hashes(pages: Iterable[bytes], what: str) -> None:
    if any(len(page) != PAGE_HASH_BYTES for page in pages):
        raise InvalidArgument(f"{what}: page hashes are {PAGE_HASH_BYTES}-byte sha256 digests")


@dataclass(frozen=True)
class PrefetchRequest:
    op_id: int
    pages: tuple[bytes, ...]  # page hashes, in chain order
    tokens: int
    parent: bytes | None = None  # the page before pages[0], if any
    hold: bool = False  # once done, its pages stay until released (`hold_releases`, or a revoke of it ended)


@dataclass(frozen=True)
class WriteRequest:
    op_id: int
    pages: tuple[bytes, ...]
    device_pages: tuple[int, ...]
    parent: bytes | None = None


@dataclass(frozen=True)
class LoadRequest:
    op_id: int
    pages: tuple[bytes, ...]
    device_pages: tuple[int, ...]
    signal_slot: int = 0  # where this rank's copy publishes its layers (0: nowhere); local, never agreed


@dataclass(frozen=True)
class CacheRequests:
    prefetches: tuple[PrefetchRequest, ...] = ()
    prefetch_polls: tuple[int, ...] = ()
    revokes: tuple[int, ...] = ()
    writes: tuple[WriteRequest, ...] = ()
    loads: tuple[LoadRequest, ...] = ()
    hold_releases: tuple[int, ...] = ()  # ended prefetches whose held pages may go

    def empty(self) -> bool:
        return not (self.prefetches or self.prefetch_polls or self.revokes or self.writes or self.loads
                    or self.hold_releases)

    def count(self) -> int:
        return (len(self.prefetches) + len(self.prefetch_polls) + len(self.revokes) + len(self.writes)
                + len(self.loads) + len(self.hold_releases))

    def opened(self) -> tuple[PrefetchRequest | WriteRequest | LoadRequest, ...]:
        return (*self.prefetches, *self.writes, *self.loads)

    def fingerprint(self) -> int:
        """A digest of everything the step carries, equal on ranks that took
        the same step (a round's header compares it): page hashes enter as
        their bytes, which costs far less than formatting them."""
        parts = [array("q", (len(self.prefetches), len(self.writes), len(self.loads), *self.prefetch_polls,
                             -1, *self.revokes, -1, *self.hold_releases)).tobytes()]
        for req in self.prefetches:
            parts += [array("q", (req.op_id, req.tokens, len(req.pages), req.hold)).tobytes(), req.parent or b"-"]
            parts.append(b"".join(req.pages))
        for wreq in self.writes:
            parts += [array("q", (wreq.op_id, len(wreq.pages), *wreq.device_pages)).tobytes(), wreq.parent or b"-"]
            parts.append(b"".join(wreq.pages))
        for lreq in self.loads:
            parts.append(array("q", (lreq.op_id, len(lreq.pages), *lreq.device_pages)).tobytes())
            parts.append(b"".join(lreq.pages))
        return hash62(b"\x1f".join(parts))


def check_shape(requests: CacheRequests, device_pages: int, signal_slots: int = 0) -> None:
    """Refuse a malformed step: ids out of range or repeated, empty or
    oversized operations, hashes of the wrong size, device pages outside the
    attached pool of `device_pages` pages, a load's signal slot outside the
    attached board of `signal_slots` slots."""
    if requests.count() > MAX_REQUESTS_PER_STEP:
        raise InvalidArgument(f"a step carries at most {MAX_REQUESTS_PER_STEP} operations, got {requests.count()}")
    seen: set[int] = set()
    for req in requests.opened():
        check_id(req.op_id, "operation id")
        if req.op_id in seen:
            raise InvalidArgument(f"operation {req.op_id} appears twice in one step")
        seen.add(req.op_id)
        if not req.pages:
            raise InvalidArgument(f"operation {req.op_id} has no pages")
        if len(req.pages) > MAX_PAGES_PER_OP:
            raise InvalidArgument(f"operation {req.op_id} has {len(req.pages)} pages, at most {MAX_PAGES_PER_OP}")
        check_page_hashes(req.pages, f"operation {req.op_id}")
        parent: bytes | None = getattr(req, "parent", None)
        if parent is not None:
            check_page_hash(parent, f"operation {req.op_id}: parent")
        # A chain's hash covers every page before it: no chain repeats one.
        if len(set(req.pages)) != len(req.pages):
            raise InvalidArgument(f"operation {req.op_id}: a page appears twice: its pages are not a chain")
        if parent is not None and parent in req.pages:
            raise InvalidArgument(f"operation {req.op_id}: its parent is one of its pages: they are not a chain")
        if isinstance(req, PrefetchRequest):
            check_id(req.tokens, f"operation {req.op_id}: tokens")
            continue
        if len(req.device_pages) != len(req.pages):
            raise InvalidArgument(
                f"operation {req.op_id}: {len(req.pages)} pages but {len(req.device_pages)} device pages")
        bad = [d for d in req.device_pages if not 0 <= d < device_pages]
        if bad:
            raise InvalidArgument(
                f"operation {req.op_id}: device page {bad[0]} is outside the attached pool of {device_pages} pages")
    for load in requests.loads:
        if load.signal_slot and not 1 <= load.signal_slot <= signal_slots:
            raise InvalidArgument(f"load {load.op_id}: signal slot {load.signal_slot} is outside the attached "
                                  f"load-signal board ({signal_slots} slots)")
    named: set[int] = set()
    for op_id in (*requests.prefetch_polls, *requests.revokes):
        check_id(op_id, "prefetch id")
        if op_id in named:
            raise InvalidArgument(f"prefetch {op_id} is polled or revoked twice in one step")
        named.add(op_id)
    for op_id in requests.hold_releases:
        check_id(op_id, "prefetch id")
    if len(set(requests.hold_releases)) != len(requests.hold_releases):
        raise InvalidArgument("a prefetch's hold is released twice in one step")
