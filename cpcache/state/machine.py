"""The cache's replicated state machine (DESIGN sections 2 and 5).

`CacheState` holds what every rank of a domain must hold identically: the
host index, the page allocator and the table of open operations. It changes
only in `open` (a step's operations, once its round agreed that every rank
took the step) and `apply` (an agreed round result). `check` says whether a
step could open, without changing anything, and `open` checks again first,
so a refused step changes nothing (DESIGN rule 9).

It never does I/O: it emits intents for this rank's data plane and reads this
rank's progress only to fill in the local answers of a round's questions.
Every mutation is folded into a running digest, so two ranks that applied
anything differently disagree in the next round's header.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from cpcache.agreement.kinds import VOTE
from cpcache.agreement.rounds import Questions, RoundResult
from cpcache.config import CacheConfig
from cpcache.errors import CacheError, InvalidArgument, NotFound
from cpcache.hashing import hash62
from cpcache.keys import ShardingSpec
from cpcache.state.allocator import PageAllocator
from cpcache.state.host_index import Entry, HostIndex
from cpcache.state.intents import CopyToDevice, CopyToHost, Decisions, Fetch, Intent, Lookup, Store
from cpcache.state.operations import (
    Backup,
    Load,
    LocalProgress,
    Operation,
    Prefetch,
    Retirement,
    Write,
)
from cpcache.state.policies import prefetch_policy, write_policy
from cpcache.state.questions import BackupOutcome, Outcome
from cpcache.state.requests import LoadRequest, StepOps, WriteRequest, check_shape

ENDED_PREFETCHES_KEPT = 4096

OpT = TypeVar("OpT", bound=Operation)


class CacheState:
    def __init__(self, config: CacheConfig, allocator: PageAllocator, sharding: ShardingSpec, page_size: int,
                 device_pages: int) -> None:
        self.config = config
        self.prefetch_policy = prefetch_policy(config)
        self.write_policy = write_policy(config)
        self.allocator = allocator
        self.sharding = sharding
        self.page_size = page_size
        self.device_pages = device_pages
        self.index = HostIndex(track_unbacked=self.write_policy.backup_before_evict)
        self.ops: dict[int, Operation] = {}  # by serial; insertion order is serial order
        self.by_op_id: dict[int, int] = {}  # the scheduler's op id -> serial, for open prefetches, writes, loads
        # Prefetches that ended lately: a poll or revoke of one is a race the
        # scheduler cannot avoid at lag >= 1 (it learns of the end later), so
        # it is taken and ignored rather than refused.
        self.ended_prefetches: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._next_serial = 1
        self.closed: list[int] = []  # serials closed since the data plane last forgot them
        self.digest = 0
        self.step = 0  # the step whose operations opened last
        self.round = 0  # the round applied last
        self.hit_pages = {"host": 0, "storage": 0}  # pages loaded back / prefetched (agreed)
        self.writes_refused = 0  # write-throughs refused for want of evictable host pages
        self._unstarted_backups: list[Backup] = []  # queued in the round being applied

    # -- bookkeeping -------------------------------------------------------------

    def _record(self, *fields: object) -> None:
        """Fold one mutation into the digest. Page lists are hashed as their
        bytes (a repr of each would cost more than the change itself)."""
        parts = [self.digest.to_bytes(8, "little")]
        for f in fields:
            if isinstance(f, tuple | list) and f and isinstance(f[0], bytes):
                parts.append(b"".join(f))
            else:
                parts.append(repr(f).encode())
        self.digest = hash62(b"\x1f".join(parts))

    def _serial(self) -> int:
        serial = self._next_serial
        self._next_serial += 1
        return serial

    def carried_over(self, kept: list, busy: list[int]) -> None:
        """A new epoch's start: the pages kept (already restored) enter the
        digest, so ranks that started from different pages disagree at their
        first round; slots still under some rank's I/O wait for a reclaim."""
        self._record("carried over", tuple((k.page, k.slot) for k in kept), tuple(busy))
        if busy:
            self.allocator.take(list(busy))
            self._retire(list(busy))

    def _retire(self, slots: list[int]) -> None:
        if slots:
            self.allocator.retire(slots)
            retirement = Retirement(self._serial(), list(slots))
            self.ops[retirement.serial] = retirement
            self._record("retire", retirement.serial, tuple(slots))

    def _of_kind(self, kind: type[OpT]) -> list[OpT]:
        return [op for op in self.ops.values() if isinstance(op, kind)]

    def _eviction_skip(self, keep: frozenset[bytes] | set[bytes]) -> Callable[[bytes, Entry], bool]:
        # Pages used in this step stay: the scheduler was told of them (a
        # Match, an accepted prefetch) and may load them in its next step.
        backed_only = self.write_policy.backup_before_evict

        def skip(page: bytes, entry: Entry) -> bool:
            return entry.last_used >= self.step or page in keep or (backed_only and not entry.backed_up)

        return skip

    def _make_room(self, count: int, keep: set[bytes] | frozenset[bytes] = frozenset()) -> bool:
        """Free host slots by evicting least recently used pages. Evicts
        nothing when that would not make enough room."""
        short = count - self.allocator.free_count
        if short <= 0:
            return True
        evicted = self.index.evict(short, self._eviction_skip(keep), frees=_frees_slot, all_or_nothing=True)
        if not evicted:
            return False
        # An unreferenced page has no I/O on any rank: loads, backups and
        # writes hold their pages until every rank has finished with them.
        # The exception is a backup that timed out somewhere: its write may
        # still be reading, so those slots wait for an agreed reclaim.
        self._record("evict", tuple(p for p, _ in evicted))
        self.allocator.free([e.slot for _, e in evicted if not e.io_suspect])
        self._retire([e.slot for _, e in evicted if e.io_suspect])
        return True

    # -- a scheduler step ----------------------------------------------------------

    def check(self, ops: StepOps, expected_prefetches: set[int] | frozenset[int] = frozenset(),
              loads_resident: bool = True) -> None:
        """Raise the error this step would be refused with; change nothing.
        `expected_prefetches`: prefetches that steps still in the pipeline
        open, which this step may already poll or revoke. Without
        `loads_resident`, a load of pages no longer resident is not the
        step's fault (at lag >= 1 the scheduler learns of evictions late):
        it fails on its own when its step opens."""
        check_shape(ops, self.device_pages)
        for req in ops.opened():
            if req.op_id in self.by_op_id:
                raise InvalidArgument(f"operation {req.op_id} is already open")
        for op_id in (*ops.prefetch_polls, *ops.revokes):
            if self._open_prefetch(op_id) is None and op_id not in self.ended_prefetches \
                    and op_id not in expected_prefetches:
                raise NotFound(f"prefetch {op_id} is not open")
        for load in ops.loads if loads_resident else ():
            resident = self.index.prefix(list(load.pages))
            if resident < len(load.pages):
                raise NotFound(f"load {load.op_id}: page {resident} ({load.pages[resident].hex()[:16]}) is not in host")

    def _keep(self, ops: StepOps) -> set[bytes]:
        # The pages a write found resident, and every page a load reads, stay.
        reqs: tuple[WriteRequest | LoadRequest, ...] = (*ops.writes, *ops.loads)
        return {p for req in reqs for p in req.pages}

    def open(self, step: int, ops: StepOps, keep: set[bytes] | None = None) -> tuple[list[Intent], Decisions]:
        """Open a step's operations, all or none. Returns this rank's I/O to
        start and what the step decided by itself (scheduler revokes).
        `keep`: pages no eviction may take (default: the step's own)."""
        self.check(ops)
        self.step = step
        keep = self._keep(ops) if keep is None else keep
        intents: list[Intent] = []
        decided = Decisions()
        for load in ops.loads:
            intents += self._open_load(load)
        for op_id in ops.revokes:
            if (pf := self._open_prefetch(op_id)) is not None:
                self._revoke(pf, "revoked by the scheduler", decided)
        for req in ops.prefetches:
            prefetch = Prefetch(self._serial(), req)
            self._add(prefetch, req.op_id)
            self._record("prefetch", prefetch.serial, req.op_id, req.pages)
            intents.append(Lookup(prefetch.serial, tuple(req.pages), self.sharding))
        for op_id in ops.prefetch_polls:
            if (pf := self._open_prefetch(op_id)) is not None:
                pf.polled_at = step
                self._record("poll", pf.serial)
        for write in ops.writes:
            intents += self._open_write(write, keep, decided)
        return intents, decided

    def open_each(self, step: int, ops: StepOps) -> tuple[list[Intent], Decisions]:
        """Open a step's operations one at a time, in `open`'s order; one that
        cannot open fails on its own, by op id (a load in load_failures, a
        write in write_failures, a prefetch revoked with the reason). The
        whole step's pages stay, as when it opens as a whole."""
        intents: list[Intent] = []
        decided = Decisions()
        keep = self._keep(ops)
        singles = ([StepOps(loads=(r,)) for r in ops.loads] + [StepOps(revokes=(i,)) for i in ops.revokes]
                   + [StepOps(prefetches=(r,)) for r in ops.prefetches]
                   + [StepOps(prefetch_polls=(i,)) for i in ops.prefetch_polls]
                   + [StepOps(writes=(r,)) for r in ops.writes])
        for single in singles:
            try:
                opened, decisions = self.open(step, single, keep)
            except CacheError as exc:
                for load in single.loads:
                    decided.load_failures.append(load.op_id)
                for write in single.writes:
                    decided.write_failures.append(write.op_id)
                for prefetch in single.prefetches:
                    decided.prefetch_revoked.append((prefetch.op_id, f"cannot open: {exc}"))
                self._record("refused", step, repr(single))
                continue
            intents += opened
            decided.merge(decisions)
        return intents, decided

    def _open_prefetch(self, op_id: int) -> Prefetch | None:
        op = self.ops.get(self.by_op_id.get(op_id, 0))
        return op if isinstance(op, Prefetch) else None

    def _add(self, op: Operation, op_id: int) -> None:
        self.ops[op.serial] = op
        self.by_op_id[op_id] = op.serial

    def _close(self, op: Operation, op_id: int | None = None) -> None:
        del self.ops[op.serial]
        self.closed.append(op.serial)
        if op_id is not None:
            del self.by_op_id[op_id]
        if isinstance(op, Prefetch):
            self.ended_prefetches[op.request.op_id] = None
            while len(self.ended_prefetches) > ENDED_PREFETCHES_KEPT:
                self.ended_prefetches.popitem(last=False)

    def _open_write(self, req: WriteRequest, keep: set[bytes], decided: Decisions) -> list[Intent]:
        # Each write gets its own slots (two writes of one page both copy it).
        resident = self.index.resident()
        new = [i for i, p in enumerate(req.pages) if p not in resident]
        if not self._make_room(len(new), keep):
            # A full pool is not a scheduler error: this write fails, alike on every rank.
            self._record("write refused", req.op_id)
            self.writes_refused += 1
            decided.write_failures.append(req.op_id)
            return []
        write = Write(self._serial(), req, new, self.allocator.allocate(len(new)))
        self._add(write, req.op_id)
        self._record("write", write.serial, req.op_id, req.pages, tuple(write.slots))
        return [CopyToHost(write.serial, tuple(req.device_pages[i] for i in new), tuple(write.slots))]

    def _open_load(self, req: LoadRequest) -> list[Intent]:
        pages = list(req.pages)
        entries = [self.index[p] for p in pages]  # `check` found them all resident
        load = Load(self._serial(), req, [e.slot for e in entries])
        self.index.ref(pages, +1)
        self.index.touch(pages, self.step, hit=True)
        self._add(load, req.op_id)
        self.hit_pages["host"] += len(pages)
        self._record("load", load.serial, req.op_id, req.pages)
        if self.write_policy.backup_when_hot:
            self._queue_backup([p for p, e in zip(pages, entries) if e.hits == 2 and not e.backed_up])
        return [CopyToDevice(load.serial, req.op_id, tuple(load.slots), req.device_pages)]

    def _queue_backup(self, pages: list[bytes]) -> None:
        if pages:
            self.index.ref(pages, +1)
            backup = Backup(self._serial(), pages)
            self.ops[backup.serial] = backup
            self._unstarted_backups.append(backup)
            self._record("backup", backup.serial, tuple(pages))

    # -- a round --------------------------------------------------------------------

    def questions(self, local: LocalProgress) -> tuple[Questions, dict[int, Operation]]:
        """This round's cache questions with this rank's local answers, and
        the asking operations by serial (named only if a divergence needs
        it). The set depends only on shared state."""
        ids: list[int] = []
        kinds: list[int] = []
        reduces: list[int] = []
        values: list[int] = []
        asking: dict[int, Operation] = {}
        backups = 0
        for op in self.ops.values():
            if isinstance(op, Backup):
                backups += 1
                if backups > self.config.backup_window:
                    continue
            for kind, value in op.ask(self, local):
                assert kind.reduce is not None, f"{kind.name}: a cache question names its reduction"
                ids.append(op.serial)
                kinds.append(kind.code)
                reduces.append(kind.reduce)
                values.append(int(value))
                asking[op.serial] = op
        columns = (np.array(c, dtype=np.int64) for c in (ids, kinds, reduces, values))
        return Questions(*columns), asking

    def take_closed(self) -> list[int]:
        """The serials closed since the last call: the data plane forgets them."""
        closed, self.closed = self.closed, []
        return closed

    def open_questions(self) -> int:
        """Operations the next rounds may ask about."""
        return len(self.ops)

    def apply(self, result: RoundResult) -> tuple[Decisions, list[Intent]]:
        """Apply an agreed round, operation by operation in serial order.
        Answers about operations that have closed since are ignored."""
        self.round = result.number
        answers: dict[int, dict[int, int]] = {}
        for serial, kind, value in zip(result.op_ids.tolist(), result.kinds.tolist(), result.values.tolist()):
            if kind != VOTE.code:
                answers.setdefault(serial, {})[kind] = value
        decisions, intents = Decisions(), []
        for serial in sorted(answers):
            op = self.ops.get(serial)
            if op is not None:
                intents += op.settle(self, answers[serial], decisions)
        self._relieve_pressure()
        intents += self._start_backups()
        return decisions, intents

    # -- what operations call when they settle ----------------------------------------

    def decide_hit(self, pf: Prefetch, hit: int, decisions: Decisions) -> list[Intent]:
        pf.hit = hit
        self._record("hit", pf.serial, hit)
        decisions.prefetch_hits.append((pf.request.op_id, hit))
        if hit * self.page_size < self.config.prefetch_threshold_tokens:
            self._revoke(pf, f"storage hit of {hit * self.page_size} tokens is below the threshold", decisions)
            return []
        if not self._make_room(hit):
            self._revoke(pf, f"host pool full: {hit} pages do not fit", decisions)
            return []
        pf.slots = self.allocator.allocate(hit)
        self._record("fetch", pf.serial, tuple(pf.slots))
        return [Fetch(pf.serial, tuple(pf.request.pages[:hit]), tuple(pf.slots), self.sharding)]

    def _revoke(self, pf: Prefetch, why: str, decisions: Decisions) -> None:
        self._close(pf, pf.request.op_id)
        self._record("revoke", pf.serial)
        self._retire(pf.slots)  # back to the allocator once no rank reads into them
        decisions.prefetch_revoked.append((pf.request.op_id, why))

    def end_prefetch(self, pf: Prefetch, done: int, decisions: Decisions) -> None:
        self._close(pf, pf.request.op_id)
        kept_pages, kept_slots = [], []
        for page, slot in zip(pf.request.pages[:done], pf.slots):
            if page in self.index:
                break  # already resident (another operation brought it): keep that copy
            kept_pages.append(page)
            kept_slots.append(slot)
        self.index.insert(kept_pages, kept_slots, pf.request.parent, self.step)
        for page in kept_pages:
            self.index[page].backed_up = True  # it came from storage
        self._record("accept", pf.serial, len(kept_pages))
        self._retire(pf.slots[len(kept_pages):])  # the unagreed tail, once its reads end
        decisions.prefetch_done.append((pf.request.op_id, len(kept_pages)))
        self.hit_pages["storage"] += len(kept_pages)

    def ack_write(self, w: Write, decisions: Decisions) -> None:
        """Every rank's copy ended well: the pages enter the host index."""
        self._close(w, w.request.op_id)
        slot_of = dict(zip(w.new, w.slots))
        pages = w.request.pages
        inserted: list[bytes] = []
        duplicate: list[int] = []
        resident = self.index.resident()
        run: list[int] = []  # indices of a run of consecutive pages entering together (one chain)
        entering: set[bytes] = set()  # the run's pages (a page twice in one write enters once)

        def insert_run() -> None:
            if run:
                parent = pages[run[0] - 1] if run[0] else w.request.parent
                self.index.insert([pages[i] for i in run], [slot_of[i] for i in run], parent, self.step)
                inserted.extend(pages[i] for i in run)
                run.clear()
                entering.clear()

        for i, page in enumerate(pages):
            slot = slot_of.get(i)
            if slot is None or page in resident or page in entering:
                insert_run()
                if slot is not None:
                    duplicate.append(slot)  # another operation brought it meanwhile
                continue  # (else: it was resident when the write opened)
            run.append(i)
            entering.add(page)
        insert_run()
        self.allocator.free(duplicate)  # every rank's copy into it has ended
        self.index.touch([p for p in pages if p in resident], self.step)
        self._record("ack", w.serial, tuple(duplicate))
        decisions.write_acks.append(w.request.op_id)
        if self.write_policy.backup_after_ack:
            self._queue_backup(inserted)

    def fail_write(self, w: Write, decisions: Decisions) -> None:
        """Some rank's copy failed; every rank's has ended: the slots are free."""
        self._close(w, w.request.op_id)
        self.allocator.free(w.slots)
        self._record("write failed", w.serial)
        decisions.write_failures.append(w.request.op_id)

    def end_backup(self, backup: Backup, outcome: BackupOutcome, decisions: Decisions) -> None:
        self._close(backup)
        stored, suspect = outcome == BackupOutcome.STORED, outcome == BackupOutcome.TIMED_OUT
        index = self.index
        for page in backup.pages:
            entry = index[page]
            entry.refs -= 1
            if entry.backed_up and not stored:
                index.mark_backed_up(page, False)
            entry.backed_up = stored
            entry.io_suspect = entry.io_suspect or suspect
        self._record("backed up", backup.serial, int(outcome))
        decisions.backups.append((backup.serial, outcome == BackupOutcome.STORED))

    def end_load(self, load: Load, outcome: Outcome, decisions: Decisions) -> None:
        self._close(load, load.request.op_id)
        self.index.ref(list(load.request.pages), -1)
        self._record("loaded", load.serial, int(outcome))
        if outcome == Outcome.OK:
            decisions.loads.append((load.request.op_id, len(load.slots)))
        else:
            decisions.load_failures.append(load.request.op_id)

    def reclaim(self, retirement: Retirement) -> None:
        self._close(retirement)
        self.allocator.reclaim(retirement.slots)
        self._record("reclaim", retirement.serial)

    def _relieve_pressure(self) -> None:
        """Under write_back only backed-up pages may be evicted: when free
        slots run low, back up the least recently used pages that are not."""
        if not self.write_policy.backup_before_evict:
            return
        low_water = max(1, self.allocator.pages // 8)
        short = low_water - self.allocator.free_count
        if short <= 0:
            return
        # A page queued for a backup already holds a reference: not taken twice.
        self._queue_backup(self.index.least_recent_unbacked(short))

    def _start_backups(self) -> list[Intent]:
        """Backups not yet started (they start in the round they are queued)."""
        intents: list[Intent] = []
        backups, self._unstarted_backups = self._unstarted_backups, []
        entries = self.index
        for backup in backups:
            slots = tuple(entries[p].slot for p in backup.pages)
            intents.append(Store(backup.serial, tuple(backup.pages), slots, self.sharding))
        return intents

    # -- reads --------------------------------------------------------------------------

    def match(self, pages: list[bytes]) -> int:
        return self.index.prefix(pages)

    def stats(self) -> dict[str, int]:
        counts = {kind: len(self._of_kind(kind)) for kind in (Prefetch, Write, Backup, Load)}
        return {
            "host_pages_used": len(self.index),
            "host_pages_free": self.allocator.free_count,
            "host_pages_retiring": sum(len(r.slots) for r in self._of_kind(Retirement)),
            "open_prefetches": counts[Prefetch],
            "open_writes": counts[Write],
            "open_backups": counts[Backup],
            "open_loads": counts[Load],
            "host_hit_pages": self.hit_pages["host"],
            "storage_hit_pages": self.hit_pages["storage"],
            "writes_refused_host_full": self.writes_refused,
        }


def _frees_slot(entry: Entry) -> bool:
    """An evicted page whose backup timed out somewhere leaves its slot
    retiring, not free: it does not count as room."""
    return not entry.io_suspect
