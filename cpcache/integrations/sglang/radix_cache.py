"""SGLang's unified radix tree with cpcache below the device tier.

SGLang keeps the device tree (match, insert, evict) exactly as it is; the
rank's daemon is the host and storage tiers. Every decision that ranks must
share comes from the daemon's agreed replies, never from a collective here.
What each SGLang call does: docs/sglang-backend.md (the call table); the
storage-prefetch calls are a layer of their own below this class
(`storage_prefetch.py`).

Evicting a device node needs no copy: its pages were written through, so a
later match finds them in the host pool and loads them back.

Between two steps nothing here asks the daemon: host matches come from the
mirror of the host pool that the scheduler-side session keeps (agreed state,
`cpcache/client/session.py`). So a daemon that cannot answer (it died, or
its domain lost a peer) is found at a step, and a step fails alike on every
rank (a lost peer is agreed within `agreement_timeout_s`): every rank falls
back to SGLang's device-only tree at the same iteration, releasing the locks
of writes in flight. Every rank then tries to attach again at the same later
iterations (`reattach.py`); Attach is agreed, so every rank comes back at the
same iteration, warm with the host pages the re-formed domain carried over
and with storage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.unified_radix_cache import NodeId

from cpcache.client.outcomes import DecisionLog, Tally
from cpcache.client.session import SchedulerSession
from cpcache.errors import CacheError
from cpcache.integrations.sglang.flush_records import Publisher
from cpcache.integrations.sglang.host_hits import HostHit, HostPoolView
from cpcache.integrations.sglang.layer_loads import LayerLoads
from cpcache.integrations.sglang.lost_hits import LostHits
from cpcache.integrations.sglang.page_names import PageNames
from cpcache.integrations.sglang.pool import SharedPool
from cpcache.integrations.sglang.quarantine import Quarantine
from cpcache.integrations.sglang.reattach import AttachAgain, NotServingYet
from cpcache.integrations.sglang.storage_prefetch import StoragePrefetching
from cpcache.integrations.sglang.timing import SchedulerTime
from cpcache.integrations.sglang.tree_events import TreeEvents

log = logging.getLogger(__name__)
__all__ = ["CpcacheRadixCache", "NotServingYet"]


class CpcacheRadixCache(StoragePrefetching):
    def __init__(self, params: Any, *, daemon_session: SchedulerSession, pool: SharedPool,
                 attach_again: Callable[[], SchedulerSession] | None = None, reattach_after: int = 64,
                 storage_prefetch: bool = True, rank: int = 0, host_pages: int = 0,
                 decisions: DecisionLog | None = None, layer_loads: LayerLoads | None = None,
                 daemon_quiet: Callable[[int | None], bool] | None = None, storage: str = "none",
                 flushes: Publisher | None = None) -> None:
        # Everything is set before the parent's constructor, which calls reset().
        self._built = False  # that reset() has nothing of cpcache's to flush yet
        # The rank's daemon (`self.session` is SGLang's own, its streaming sessions).
        self.daemon_session: SchedulerSession | None = None  # None: fallen back to the device tree
        self._write_locks: dict[int, tuple[NodeId, Any]] = {}  # lock number -> (node, lock) while a write is open
        # Device slots of loads never decided (their step failed): quarantine.py.
        self._quarantined = Quarantine()
        self.clock = SchedulerTime()
        self._past_tallies: list[Tally] = []  # of the sessions left behind (the logged line counts their steps)
        self.names = PageNames(flushes)
        self.shared_pool = pool
        self.storage_prefetch = storage_prefetch
        self.rank = rank
        self._host_hits: dict[str, HostHit] = {}
        self.lost_hits = LostHits()
        self._loading = False  # inserting pages loaded from the host: they are there already
        self._locks = 0
        self.fallback_reason = ""
        self.fallbacks = 0  # times the daemon was left
        self.reattaches = 0  # times it was attached again
        self._again = AttachAgain(rank, attach_again, reattach_after)  # counts the iterations too
        self.host_pages = host_pages
        self.decisions = decisions
        # The overlapped load-back (None: blocking): layer_loads.py.
        self.layer_loads = layer_loads
        if layer_loads is not None:
            layer_loads.clock = self.clock
        # Makes sure the daemon of a session (by its epoch) writes nothing
        # more into device slots: -> whether it is so (backend.py).
        self._daemon_quiet = daemon_quiet
        self._session_epoch: int | None = daemon_session.epoch
        super().__init__(params)
        # KV events of the host pool and storage (tree_events.py).
        self.tree_events = TreeEvents.of(params, self.page_size, storage, rank) if not self.disable else None
        self.daemon_session = daemon_session
        self._listen(daemon_session)
        self._built = True

    def _release_write_locks(self) -> None:
        for node, lock in self._write_locks.values():
            self.dec_lock_ref(node, lock)
        self._write_locks.clear()

    def _fall_back(self, exc: CacheError) -> None:
        """Go on device-only: the daemon cannot decide any more."""
        self._again.fell_back()
        log.error("cpcache: rank %d fell back to the device tree at iteration %d: the daemon cannot answer (%s); "
                  "attaching again from iteration %s", self.rank, self._again.iteration, exc, self._again.next_try)
        self.fallback_reason = str(exc)
        self.fallbacks += 1
        if self.daemon_session is not None:
            self._past_tallies.append(self.daemon_session.tally)
            self._session_epoch = self.daemon_session.epoch
        self.daemon_session = None
        self._host_hits.clear()
        self._release_write_locks()
        if self.tree_events is not None:
            self.tree_events.tiers.host_lost()

    def _try_attach_again(self) -> None:
        """Every rank runs this at the same iteration; Attach is agreed, so
        every rank is attached again, or none is."""
        session = self._again.attempt()
        if session is None:
            return
        self.daemon_session = session
        self._listen(session)
        self.reattaches += 1
        # The old session ended on the daemon (its copies too) before the new one began.
        self._log_given_back(self._quarantined.release(self.token_to_kv_pool_allocator.free))
        self.fallback_reason = ""
        log.warning("cpcache: rank %d attached again at iteration %d; host and storage tiers in use again",
                    self.rank, self._again.iteration)

    # -- KV events of the tiers below ---------------------------------------------------

    def _listen(self, session: SchedulerSession) -> None:
        if self.tree_events is not None:
            self.tree_events.listen(session)

    def _name_pages(self, key: Any, hashes: list[bytes], first: int) -> list[bytes]:
        """The pages `first`... of `key`, named for the events they may enter a tier with."""
        if self.tree_events is not None:
            self.tree_events.name_pages(key, hashes, first, self.names.generation)
        return hashes[first:]

    def take_events(self) -> list:
        """SGLang's publisher's drain (each iteration, on the publishing rank):
        the device tree's events, then the host pool's and storage's."""
        events = list(super().take_events())
        if self.tree_events is not None:
            events += self.tree_events.tiers.take()
        return events

    # -- keys -------------------------------------------------------------------------

    def page_hashes(self, key: Any) -> list[bytes]:
        """The storage names of `key`'s full pages (page_names.py)."""
        return self.names.of(key, self.page_size)

    # -- device -> host ---------------------------------------------------------------

    def insert(self, params: InsertParams) -> InsertResult:
        result = super().insert(params)
        if self.daemon_session is not None and not self._loading and not self.disable:
            with self.clock.call("insert"):
                self._write_through(self.daemon_session, params.key, result.prefix_len)
        return result

    def _write_through(self, session: SchedulerSession, key: Any, known_tokens: int) -> None:
        """Device -> host: the new full pages of `key`, their node locked until decided."""
        ps = self.page_size
        hashes = self.page_hashes(key)
        first = known_tokens // ps
        if first >= len(hashes):
            return
        matched = super().match_prefix(MatchPrefixParams(key=key[: len(hashes) * ps]))
        indices = self.path_device_indices(matched.last_device_node)
        if len(indices) < len(hashes) * ps:
            return  # not all on the device (a concurrent eviction): nothing to write
        node = matched.last_device_node
        self._locks += 1
        number = self._locks
        self._write_locks[number] = (node, self.inc_lock_ref(node).to_dec_params())
        device_pages = (indices[first * ps : len(hashes) * ps : ps] // ps).tolist()
        self._name_pages(key, hashes, first)

        def done(_stored: bool) -> None:
            held = self._write_locks.pop(number, None)
            if held is not None:
                self.dec_lock_ref(*held)

        session.write_through(hashes[first:], device_pages, hashes[first - 1] if first else None, done)

    # -- host -> device ---------------------------------------------------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        result = super().match_prefix(params)
        with self.clock.call("match"):
            return self._match_host(params, result)

    def _match_host(self, params: MatchPrefixParams, result: MatchResult) -> MatchResult:
        """The host pages that follow SGLang's device match."""
        req = params.req
        session = self.daemon_session
        if req is None or self.disable:
            return result
        if session is None:
            self.lost_hits.fell_back(req.rid, (len(params.key) - result.device_prefix_len) // self.page_size)
            return result
        self._host_hits.pop(req.rid, None)
        streaming = getattr(req, "session", None)  # SGLang's streaming session of the request, if any
        if streaming is not None and getattr(streaming, "streaming", False):
            return result  # a streaming session's KV is its slot's, not the tree's: nothing to extend
        hashes = self.page_hashes(params.key)
        on_device = result.device_prefix_len // self.page_size
        host = session.match(hashes[on_device:])
        if host and session.in_flight():
            # A hit is loaded in this iteration: take the step in flight first,
            # so that no round lands between the match and the load.
            try:
                session.take_reply()
            except CacheError as exc:
                self._fall_back(exc)
                return result
            host = session.match(hashes[on_device:])
        if host == 0:
            return result
        self._host_hits[req.rid] = HostHit(params.key, on_device, hashes[on_device : on_device + host])
        hit_tokens = host * self.page_size
        return result._replace(
            last_host_node=result.last_device_node,
            best_match_node=result.last_device_node,
            host_hit_length=hit_tokens,
            full_kv_hit_length=max(result.full_kv_hit_length, result.device_prefix_len + hit_tokens),
        )

    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, NodeId]:
        with self.clock.call("load_back"):
            loaded = self._load_back(params)
            if loaded[0] and params.req is not None and self.daemon_session is not None:
                self.daemon_session.release_hold(params.req.rid)  # its load is sent: its pages are referenced
            return loaded

    def _load_back(self, params: InitLoadBackParams) -> tuple[int, NodeId]:
        """Host -> device: the host hit of the request's match, loaded before its batch runs."""
        req = params.req
        session = self.daemon_session
        hit = self._host_hits.pop(req.rid, None) if req is not None and session is not None else None
        fallback = req.last_node if req is not None else params.best_match_node
        if hit is None or session is None:
            return 0, fallback
        ps = self.page_size
        tokens = len(hit.pages) * ps
        slots = self.token_to_kv_pool_allocator.alloc(tokens)
        if slots is None:
            self.evict(EvictParams(num_tokens=tokens))
            slots = self.token_to_kv_pool_allocator.alloc(tokens)
        if slots is None:
            self.lost_hits.lost("device_full", len(hit.pages))
            return 0, fallback  # no room: the request computes its prefix
        try:
            loaded = self._load(session, hit.pages, (slots[::ps] // ps).tolist())
        except CacheError as exc:
            self._quarantined.hold(slots)  # undecided: the copy may still land there
            self._fall_back(exc)
            return 0, fallback
        if not loaded:
            self.lost_hits.lost("load_failed", len(hit.pages))
            self.token_to_kv_pool_allocator.free(slots)  # an agreed failure: every copy has ended
            return 0, fallback
        prefix_tokens = hit.device_pages * ps
        key = hit.key[: prefix_tokens + tokens]
        on_device = super().match_prefix(MatchPrefixParams(key=key[:prefix_tokens]))
        prefix = self.path_device_indices(on_device.last_device_node)[:prefix_tokens]
        self._loading = True
        try:
            # The prefix's slots are the tree's own (prev_prefix_len); pages that
            # reached the tree meanwhile make ours duplicates, which SGLang frees.
            super().insert(InsertParams(key=key, value=torch.cat([prefix, slots]), prev_prefix_len=prefix_tokens))
        finally:
            self._loading = False
        loaded = super().match_prefix(MatchPrefixParams(key=key))
        return tokens, loaded.last_device_node

    def _load(self, session: SchedulerSession, pages: list[bytes], device_pages: list[int]) -> bool:
        """Load `pages` into `device_pages`: -> whether the forward may read them.
        Overlapped (layer_loads.py), once the load's round opened it;
        blocking, once decided."""
        if self.layer_loads is None or not self.layer_loads.has_room():
            return session.load_now(pages, device_pages)
        return self.layer_loads.open(session, pages, device_pages, self.rank)

    def ready_to_load_host_cache(self) -> int:
        """The index the batch just built waits on, layer by layer (-1: it
        loads nothing, or loads end in init_load_back: the blocking path)."""
        return self.layer_loads.start_batch() if self.layer_loads is not None else -1

    # -- the iteration boundary ------------------------------------------------------------

    def check_hicache_events(self) -> None:
        """Once per scheduler iteration, on every rank: the iteration's step."""
        with self.clock.hook() as iteration:
            iteration.idle = not self._iterate()
            if self.layer_loads is not None:
                self._check_overlapped_loads()

    def _check_overlapped_loads(self) -> None:
        session = self.daemon_session
        if session is not None and self.layer_loads is not None:
            self.layer_loads.forget_decided(session.load_pending)

    def _iterate(self) -> bool:
        """-> whether the daemon was called (a reply taken, a step sent, an attach tried)."""
        self._again.iteration += 1
        if self.daemon_session is None:
            if self._again.due():
                self._try_attach_again()
                return True
            return False
        try:
            return self.daemon_session.iterate()
        except CacheError as exc:
            self._fall_back(exc)
            return True

    def log_scheduler_time(self) -> None:
        current = [self.daemon_session.tally] if self.daemon_session is not None else []
        log.info("%s", self.clock.line(self.rank, [*self._past_tallies, *current]))
        log.info("%s", self.lost_hits.line(self.rank))
        if self.decisions is not None:
            log.info("cpcache: rank %d decision log: %d steps, digest %s; since the last attach %d steps, digest %s",
                     self.rank, len(self.decisions.entries), self.decisions.digest(), *self.decisions.session())
        if self.tree_events is not None:
            self.tree_events.log_counts()

    def _log_given_back(self, tokens: int) -> None:
        if tokens:
            log.warning("cpcache: rank %d gave back %d device slots of loads its last session left undecided",
                        self.rank, tokens)

    def protected_size(self) -> int:
        """SGLang's protected tokens, with the quarantined slots: held by the
        cache, neither free nor evictable (SGLang's idle leak check)."""
        return super().protected_size() + self._quarantined.tokens()

    def has_pending_cache_operations(self) -> bool:
        return self.daemon_session is not None and self.daemon_session.busy()

    def supports_retraction_backup(self) -> bool:
        return False

    def clear_storage_backend(self) -> bool:
        """SGLang's /clear_hicache_storage: the pages stored so far are never
        matched again (hashes chain from a new seed), alike on every rank."""
        self.names.flushed()
        self._host_hits.clear()
        if self.tree_events is not None:
            self.tree_events.tiers.left_behind()
        log.info("cpcache: rank %d left its stored pages behind (cleared storage tier)", self.rank)
        return True

    @property
    def token_to_kv_pool_host(self) -> HostPoolView:
        """What SGLang's metrics read of a host tier (`--enable-metrics`)."""
        resident = len(self.daemon_session.host) if self.daemon_session is not None else 0
        return HostPoolView(self.host_pages * self.page_size, resident * self.page_size)

    def reset(self) -> None:
        """SGLang's flush_cache: every device page is about to be free. Writes
        no step carried yet are dropped; those a step carried may still be
        copying from their device pages, so they are decided first."""
        if not self._built:  # the parent's constructor: nothing of cpcache's to flush
            super().reset()
            return
        # SGLang flushes after a weight update too ("the cache the old weights
        # produced"): what the host pool and storage hold must not be matched
        # any more, as SGLang's own HiCache clears its host pool.
        self.names.flushed()
        session = self.daemon_session
        if session is not None:
            self._host_hits.clear()
            session.release_holds()  # no request matches the pages of older generations
            cancelled = session.cancel_unsent_writes()
            in_flight = session.writes_in_flight()
            try:
                session.drain_writes()
            except CacheError as exc:
                self._fall_back(exc)
            log.info("cpcache: rank %d flushed its cache: %d queued writes cancelled, %d in flight decided first",
                     self.rank, cancelled, in_flight)
        elif self._quarantined.tokens() and self._again.possible:
            # SGLang frees every device slot right after this, the quarantined
            # ones too, while the daemon of the ended session may still copy
            # into them: attaching now ends that session first (every rank
            # flushes at the same iteration, and Attach is agreed).
            self._try_attach_again()
            held = self._quarantined.tokens()
            if held and self._daemon_quiet is not None and self._daemon_quiet(self._session_epoch):
                log.warning("cpcache: rank %d flushed while %d device slots of an undecided load were held; the "
                            "daemon of that session writes nothing more (its session ended, or it was stopped)",
                            self.rank, held)
            elif held:
                log.error("cpcache: rank %d flushed while %d device slots of an undecided load were held (the daemon "
                          "could not be attached again, nor stopped): a copy of that session may still land in them",
                          self.rank, held)
        self.log_scheduler_time()
        self._release_write_locks()
        # SGLang clears its KV allocator right after this, held slots included:
        # they must not be freed a second time when the daemon is attached again.
        self._quarantined.forget()
        if self.tree_events is not None:
            self.tree_events.tiers.forget()  # SGLang's own AllBlocksCleared, queued next, says it
        super().reset()
