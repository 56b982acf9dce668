"""KV events for the tiers cpcache holds below SGLang's device tree, in
SGLang's own format and through its own publisher (docs/sglang.md, "KV
events").

SGLang's scheduler publishes what its radix cache queues (`take_events`,
drained at every iteration when `--kv-events-config` is set, on the one
rank per DP replica whose tree records events: pipeline, attention TP and
attention CP rank 0). The device tree queues its own `GPU` events as
always; `TierEvents` queues, beside them:

- `BlockStored` / `BlockRemoved` with medium `CPU_PINNED` as pages enter
  and leave the domain's host pool (`StepReply.host_entered` /
  `host_left`: agreed, the same on every rank);
- `BlockStored` with the storage's medium (`DISK` for the file backend,
  `EXTERNAL` for Mooncake or any other store) as a backup is agreed stored
  (`StepReply.backups`, each naming the pages it wrote);
- `BlockRemoved` with the storage's medium for a page published as stored
  that an agreed lookup found missing (a prefetch's storage hit stopped
  before it): the daemons evict and delete damaged pages on their own,
  unagreed and unreported, so this is how a removal is learnt;
- nothing for a flush: SGLang's own `AllBlocksCleared` says it, and what
  was queued or known before it is forgotten.

Block hashes are SGLang's for the same tokens (`SglangHashes`): the
int64 of each page's event hash, chained from the root, namespaced as its
recorder namespaces them (cache salt, LoRA adapter, the dynamo format), so
a gateway indexes these blocks as a plain SGLang server's. The tokens of a
page are kept from the write or prefetch that names it until it leaves the
host pool; a page nobody here named (one a restarted daemon carried over
from a session this process never saw) is not published.

Bounded: the events queued between two drains are capped (`MAX_QUEUED`,
the excess dropped and counted, never waited for), and so is what is kept
of pages not in the host pool (`MAX_KNOWN`).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cpcache.client.messages import StepResult
from cpcache.keys import chain

log = logging.getLogger(__name__)

MAX_QUEUED = 1 << 16  # events between two drains of the scheduler (each may hold many pages)
MAX_KNOWN = 1 << 16  # pages named by an open write or prefetch, or published in storage and not kept otherwise
MAX_PREFETCHES = 4096  # open prefetches whose pages are kept to read their storage hit against

# The medium of each storage backend a daemon names in its attach reply
# (values of SGLang's `StorageMedium`): a local file root is SGLang's DISK;
# Mooncake, or any store other than those, is EXTERNAL.
STORAGE_MEDIA = {"file": "DISK", "mooncake": "EXTERNAL"}
CPU = "CPU_PINNED"


def storage_medium(storage: str) -> str | None:
    """The event medium of the storage a daemon attached with (None: no storage)."""
    if not storage or storage == "none":
        return None
    return STORAGE_MEDIA.get(storage, "EXTERNAL")


@dataclass(frozen=True, slots=True)
class PageEvent:
    """What a `BlockStored` says of one page."""

    block_hash: int
    parent: int | None  # the block hash of the page before it (None: the first page)
    tokens: tuple[int, ...]
    cache_salt: str | None
    lora_name: str | None


class SglangHashes:
    """SGLang's KV event hashes of a request's pages, as its recorder
    (`sglang.srt.mem_cache.events.KVCacheEventRecorder`) computes them for
    the tree nodes holding those tokens: SHA-256 page hashes chained from the
    root (from the cache salt's seed when the request has one), each page's
    first 8 bytes as a signed int64, namespaced by the LoRA adapter (or, in
    the dynamo format, by the extra key and salt)."""

    def __init__(self, page_size: int, dynamo_format: bool = False, lora_names: Any = None) -> None:
        self.page_size = page_size
        self.dynamo_format = dynamo_format
        self.lora_names = lora_names

    def pages(self, tokens: Sequence[int], extra_key: str | None, cache_salt: str | None,
              first: int = 0, storage_hashes: Sequence[bytes] | None = None) -> list[PageEvent]:
        """The events of full pages `first`... of `tokens`. `storage_hashes`:
        SGLang's storage hashes of these tokens from the first page (the
        backend's page keys before any flush), reused when they are the event
        hashes too (no namespace) rather than computed again."""
        from sglang.srt.disaggregation.kv_events import kv_event_namespace_seed, namespaced_block_hash
        from sglang.srt.mem_cache.utils import hash_str_to_int64

        ps = self.page_size
        full = len(tokens) // ps
        if first >= full:
            return []
        if extra_key is None and cache_salt is None and storage_hashes is not None and len(storage_hashes) >= full:
            hashes = [h.hex() for h in storage_hashes[:full]]
        else:
            seed = None
            if cache_salt is not None:  # compute_node_event_hash_values: the salt's chain, without the extra key
                seed = hashlib.sha256(b"sglang-cache-salt-v1\0" + cache_salt.encode("utf-8")).hexdigest()
            hashes = chain(tokens[: full * ps], ps, seed)
        lora_name = self._lora_name(extra_key)
        if self.dynamo_format:
            namespace = kv_event_namespace_seed(extra_key=extra_key, cache_salt=cache_salt)
        else:
            namespace = kv_event_namespace_seed(extra_key=extra_key if lora_name is not None else None,
                                                cache_salt=None)
        blocks = [namespaced_block_hash(hash_str_to_int64(h), namespace_seed=namespace) for h in hashes]
        return [PageEvent(blocks[i], blocks[i - 1] if i else None, tuple(tokens[i * ps : (i + 1) * ps]), cache_salt,
                          lora_name) for i in range(first, full)]

    def _lora_name(self, extra_key: str | None) -> str | None:
        if self.lora_names is None or extra_key is None:
            return None
        if self.dynamo_format:
            return self.lora_names.resolve(extra_key)
        return self.lora_names.get(extra_key)


class TierEvents:
    """The host pool's and storage's events of one publishing rank, from the
    agreed replies its session follows (`follow`), queued until SGLang's
    scheduler takes them (`take`)."""

    def __init__(self, storage: str, *, max_queued: int = MAX_QUEUED, max_known: int = MAX_KNOWN) -> None:
        self.storage_medium = storage_medium(storage)
        self.max_queued = max_queued
        self.max_known = max_known
        self._resident: dict[bytes, PageEvent] = {}  # host pool pages, by page key
        # Named by a write or prefetch, not resident: page key -> (the order it was named in, its event).
        self._named: OrderedDict[bytes, tuple[int, PageEvent]] = OrderedDict()
        self._order = itertools.count()
        self._stored: OrderedDict[bytes, int] = OrderedDict()  # published stored in storage: page key -> block hash
        self._prefetches: OrderedDict[int, tuple[bytes, ...]] = OrderedDict()  # prefetch op -> its pages
        self._queue: list[Any] = []
        self.published = {"stored": 0, "removed": 0}  # pages, by kind
        self.dropped = 0  # events not queued: the queue was full
        self.unnamed = 0  # pages that entered a tier with no tokens known here: not published

    # -- what the scheduler names ---------------------------------------------------------

    def name(self, pages: Sequence[bytes], events: Sequence[PageEvent]) -> None:
        """Pages a write or prefetch carries (`pages`, the backend's page
        keys) and their events: kept until they enter the host pool."""
        for page, event in zip(pages, events):
            if page in self._resident:
                continue
            self._named[page] = (next(self._order), event)
            self._named.move_to_end(page)
        while len(self._named) > self.max_known:
            self._named.popitem(last=False)

    def prefetching(self, op: int, pages: Sequence[bytes]) -> None:
        """A prefetch of `pages` was queued as `op`: its storage hit says
        which page storage lacks."""
        self._prefetches[op] = tuple(pages)
        while len(self._prefetches) > MAX_PREFETCHES:
            self._prefetches.popitem(last=False)

    # -- what was agreed ---------------------------------------------------------------

    def follow(self, reply: StepResult) -> None:
        """An agreed reply: pages that entered the host pool, backups stored,
        storage hits, and pages that left the host pool, in that order (a
        backup's pages are resident until it ends)."""
        self._entered(reply.host_entered)
        if self.storage_medium is not None:
            for op, stored in reply.backups.items():
                if stored:
                    self._backed_up(reply.backup_pages.get(op, ()))
            for op, hit in reply.prefetch_hits.items():
                pages = self._prefetches.pop(op, None)
                if pages is not None and hit < len(pages):
                    self._missing_from_storage(pages[hit])
        for op in (*reply.prefetch_done, *reply.prefetch_revoked):
            self._prefetches.pop(op, None)
        self._left(reply.host_left)

    def _entered(self, pages: Sequence[bytes]) -> None:
        # host_entered is in hash order: publish in the order the pages were
        # named, so that a chain's pages follow their parents (and coalesce).
        entering = sorted((*self._named.pop(p), p) for p in pages if p in self._named)
        self.unnamed += len(pages) - len(entering)
        for _, event, page in entering:
            self._resident[page] = event
            self._store(event, CPU)

    def _backed_up(self, pages: Sequence[bytes]) -> None:
        for page in pages:
            named = self._named.get(page)
            event = self._resident.get(page) or (named[1] if named is not None else None)
            if event is None:
                self.unnamed += 1
                continue
            assert self.storage_medium is not None
            self._store(event, self.storage_medium)
            self._stored[page] = event.block_hash
            self._stored.move_to_end(page)
        while len(self._stored) > self.max_known:
            self._stored.popitem(last=False)

    def _missing_from_storage(self, page: bytes) -> None:
        block = self._stored.pop(page, None)
        if block is not None and self.storage_medium is not None:
            self._remove([block], self.storage_medium)

    def _left(self, pages: Sequence[bytes]) -> None:
        gone = [self._resident.pop(p) for p in pages if p in self._resident]
        if gone:
            self._remove([e.block_hash for e in gone], CPU)

    # -- the cache's own turns -------------------------------------------------------------

    def host_lost(self) -> None:
        """The daemon cannot be used (fallen back to the device tree): the host
        pool is no tier any more. Its pages are removed; their tokens are kept
        (bounded) for the pages a new session carries over."""
        if self._resident:
            self._remove([e.block_hash for e in self._resident.values()], CPU)
        for page, event in self._resident.items():
            self._named[page] = (next(self._order), event)
        self._resident.clear()
        while len(self._named) > self.max_known:
            self._named.popitem(last=False)
        self._prefetches.clear()

    def left_behind(self) -> None:
        """Every page held so far will never be matched again (SGLang's
        /clear_hicache_storage): the host pool's and storage's are removed."""
        if self._resident:
            self._remove([e.block_hash for e in self._resident.values()], CPU)
        if self._stored and self.storage_medium is not None:
            self._remove(list(self._stored.values()), self.storage_medium)
        self._forget_pages()

    def forget(self) -> None:
        """A flush: SGLang's own AllBlocksCleared follows; nothing queued or
        known before it is published (pages of older flushes may share the
        new ones' block hashes, so their later evictions must not be)."""
        self._queue.clear()
        self._forget_pages()

    def _forget_pages(self) -> None:
        self._resident.clear()
        self._named.clear()
        self._stored.clear()
        self._prefetches.clear()

    # -- the queue -------------------------------------------------------------------

    def take(self) -> list[Any]:
        """The events queued since the last call, oldest first."""
        events, self._queue = self._queue, []
        return events

    def counters(self) -> dict[str, int]:
        return {"stored_pages": self.published["stored"], "removed_pages": self.published["removed"],
                "dropped_events": self.dropped, "unnamed_pages": self.unnamed, "host_pages": len(self._resident)}

    def _store(self, event: PageEvent, medium: str) -> None:
        from sglang.srt.disaggregation.kv_events import BlockStored, StorageMedium

        tail = self._queue[-1] if self._queue else None
        if (isinstance(tail, BlockStored) and tail.medium == medium and tail.cache_salt == event.cache_salt
                and tail.lora_name == event.lora_name and tail.block_size == len(event.tokens)
                and event.parent is not None and tail.block_hashes and tail.block_hashes[-1] == event.parent):
            tail.block_hashes.append(event.block_hash)
            tail.token_ids.extend(event.tokens)
        elif not self._room():
            return
        else:
            self._queue.append(BlockStored(block_hashes=[event.block_hash], parent_block_hash=event.parent,
                                           token_ids=list(event.tokens), block_size=len(event.tokens), lora_id=None,
                                           medium=StorageMedium(medium), cache_salt=event.cache_salt,
                                           lora_name=event.lora_name))
        self.published["stored"] += 1

    def _remove(self, blocks: list[int], medium: str) -> None:
        from sglang.srt.disaggregation.kv_events import BlockRemoved, StorageMedium

        tail = self._queue[-1] if self._queue else None
        if isinstance(tail, BlockRemoved) and tail.medium == medium:
            tail.block_hashes.extend(blocks)
        elif not self._room():
            return
        else:
            self._queue.append(BlockRemoved(block_hashes=list(blocks), medium=StorageMedium(medium)))
        self.published["removed"] += len(blocks)

    def _room(self) -> bool:
        if len(self._queue) < self.max_queued:
            return True
        if not self.dropped:
            log.warning("cpcache: %d KV events queued and not taken by SGLang's publisher: dropping the next ones "
                        "(counted)", len(self._queue))
        self.dropped += 1
        return False
