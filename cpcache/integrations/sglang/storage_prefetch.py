"""SGLang's storage-prefetch hooks of the radix cache (storage -> host),
answered from the daemon's agreed prefetches: a layer of `CpcacheRadixCache`
(`radix_cache.py`) of its own, between it and SGLang's `UnifiedRadixCache`.
What each call does: docs/sglang-backend.md (the call table).

A prefetch is of the pages beyond what the host pool holds, named from the
request's tokens; its pages are held in the host pool until the request is
admitted (or aborted), and reach the device through the request's next match.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.mem_cache.unified_radix_cache import NodeId, UnifiedRadixCache

from cpcache.client.session import SchedulerSession
from cpcache.integrations.sglang.host_hits import HostHit
from cpcache.integrations.sglang.timing import SchedulerTime
from cpcache.integrations.sglang.tree_events import TreeEvents

log = logging.getLogger(__name__)


class StoragePrefetching(UnifiedRadixCache):
    """The storage-prefetch hooks over the daemon's session. What they read
    of the cache is `CpcacheRadixCache`'s: the attributes below, set by its
    constructor, and its `page_hashes` and `_name_pages`."""

    daemon_session: SchedulerSession | None  # None: fallen back to the device tree
    storage_prefetch: bool
    rank: int
    clock: SchedulerTime
    tree_events: TreeEvents | None
    _host_hits: dict[str, HostHit]

    def prefetch_from_storage(self, request: Any, last_host_node_id: Any, new_input_tokens: list[int],
                              last_hash: str | None = None, prefix_keys: list[str] | None = None,
                              matched_prefix_tokens: list[int] | None = None, extra_key: str | None = None,
                              cache_salt: str | None = None, storage_hit_end: int | None = None) -> None:
        if self.daemon_session is None or not self.storage_prefetch:
            return
        with self.clock.call("prefetch"):
            self._prefetch(self.daemon_session, request, new_input_tokens, matched_prefix_tokens, extra_key, cache_salt)

    def _prefetch(self, session: SchedulerSession, request: Any, new_input_tokens: list[int],
                  matched_prefix_tokens: list[int] | None, extra_key: str | None, cache_salt: str | None) -> None:
        from sglang.srt.mem_cache.radix_cache import RadixKey

        known = list(matched_prefix_tokens or [])
        key = RadixKey(list(known) + list(new_input_tokens), extra_key=extra_key, cache_salt=cache_salt)
        hashes = self.page_hashes(key)
        first = len(known) // self.page_size
        first += session.match(hashes[first:])  # pages already in the host need no prefetch
        if first >= len(hashes):
            return
        # Held once ended: SGLang ends it when the request comes up for
        # admission, and the request may wait on while others are admitted.
        pages = self._name_pages(key, hashes, first)
        op = session.prefetch(pages, (len(hashes) - first) * self.page_size, hashes[first - 1] if first else None,
                              rid=request.rid, hold=True)
        if self.tree_events is not None:
            self.tree_events.tiers.prefetching(op, pages)

    def is_backuped(self, node_id: NodeId) -> bool:
        # SGLang asks for a storage prefetch only past a node whose pages are
        # backed up, because its storage keys chain from that node's hash.
        # cpcache chains keys from the request's tokens and skips what the
        # host pool holds, so every node is a valid anchor.
        return self.daemon_session is not None or super().is_backuped(node_id)

    def check_prefetch_progress(self, handle: Any) -> bool:
        session = self.daemon_session
        if session is None:
            return True
        with self.clock.call("progress"):
            ended = session.prefetch_ended(handle.rid)
            if ended:
                self.prefetch_loaded_tokens_by_reqid[handle] = session.take_prefetched(handle.rid) * self.page_size
            return ended

    def finish_storage_prefetch_admission(self, handle: Any, fulfilled_tokens: int, reason: str | None) -> None:
        super().finish_storage_prefetch_admission(handle, fulfilled_tokens, reason)
        if self.daemon_session is not None:  # admitted, its loads sent: its pages need no hold
            self.daemon_session.release_hold(handle.rid)

    def release_aborted_request(self, handle: Any) -> None:
        self.prefetch_loaded_tokens_by_reqid.pop(handle, None)
        self._host_hits.pop(handle.rid, None)
        if self.daemon_session is not None:
            was_open = self.daemon_session.prefetch_open(handle.rid)
            self.daemon_session.release(handle.rid)
            if was_open:
                log.info("cpcache: rank %d revoked the prefetch of aborted request %s", self.rank, handle.rid)
