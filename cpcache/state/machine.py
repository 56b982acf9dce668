"""The cache's shared state machine (DESIGN sections 2 and 5).

`CacheState` holds what every rank of a domain must hold identically: the
host index, the page allocator and the table of open operations. It changes
only in `open_step` (the operations a scheduler step carries, identical on
every rank) and `apply` (an agreed round result). It never does I/O: it emits
`Intent`s for this rank's movers, and reads this rank's progress only to
fill in the local answers of a round's questions.

Every mutation is folded into a running digest, so two ranks that applied
anything differently disagree in the next round's header.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from cpcache.config import CacheConfig
from cpcache.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from cpcache.state.host_index import HostIndex
from cpcache.keys import ShardingSpec
from cpcache.agreement.kinds import VOTE
from cpcache.agreement.rounds import Questions, RoundResult
from cpcache.values import Reduce
from cpcache.hashing import hash62
from cpcache.state.allocator import PageAllocator

MAX_PAGES_PER_OP = 1 << 16
NOT_YET = -1  # a local answer that is not known yet; MIN keeps the question open
TIMED_OUT = 2  # a backup outcome: the store did not answer; the write may still read its pages


class Q(enum.IntEnum):
    """Question kinds of cache operations (VOTE = 1 is the scheduler's own)."""

    PREFETCH_HIT = 10  # pages present in storage, from the first (MIN)
    PREFETCH_DONE = 11  # pages fetched, from the first (MIN)
    PREFETCH_MAY_END = 12  # the policy lets this rank end the prefetch (MIN of 0/1)
    WRITE_ACK = 20  # write-throughs completed, from the head of the FIFO (MIN)
    BACKUP_DONE = 30  # this backup has ended on this rank (MIN of 0/1)
    BACKUP_FAILED = 31  # this backup failed (1) or timed out (2) on this rank (MAX)
    LOAD_DONE = 40  # this load-back has ended on this rank (MIN of 0/1)
    RECLAIM = 50  # no I/O is left on these retired slots here (MIN of 0/1)


_REDUCE = {Q.BACKUP_FAILED: Reduce.MAX}
WRITE_ACK_OP = 0  # the op id of the single write-ack question


# -- what a scheduler step carries -------------------------------------------


@dataclass(frozen=True)
class PrefetchRequest:
    op_id: int
    pages: tuple[bytes, ...]  # page hashes, in chain order
    tokens: int
    parent: bytes | None = None  # the page before pages[0], if any


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


@dataclass(frozen=True)
class StepOps:
    prefetches: tuple[PrefetchRequest, ...] = ()
    prefetch_polls: tuple[int, ...] = ()
    revokes: tuple[int, ...] = ()
    writes: tuple[WriteRequest, ...] = ()
    loads: tuple[LoadRequest, ...] = ()

    def empty(self) -> bool:
        return not (self.prefetches or self.prefetch_polls or self.revokes or self.writes or self.loads)


# -- what this rank's movers are told to do -----------------------------------


@dataclass(frozen=True)
class Intent:
    op_id: int
    action: str  # "exists", "fetch", "write", "backup", "load"
    keys: tuple[str, ...] = ()
    slots: tuple[int, ...] = ()
    device_pages: tuple[int, ...] = ()
    tokens: int = 0


# -- what the scheduler is told ------------------------------------------------


@dataclass
class Decisions:
    prefetch_hits: list[tuple[int, int]] = field(default_factory=list)  # (op, pages in storage)
    prefetch_done: list[tuple[int, int]] = field(default_factory=list)  # (op, pages accepted)
    prefetch_revoked: list[tuple[int, str]] = field(default_factory=list)  # (op, why)
    write_acks: list[int] = field(default_factory=list)
    backups: list[tuple[int, bool]] = field(default_factory=list)  # (op, stored)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (op, pages loaded)

    def merge(self, other: "Decisions") -> "Decisions":
        for name, values in vars(other).items():
            getattr(self, name).extend(values)
        return self


class LocalProgress(Protocol):
    """This rank's I/O progress, read when a round is packed."""

    def exists(self, op_id: int) -> int: ...  # NOT_YET until known

    def fetched(self, op_id: int) -> int: ...  # pages done, from the first

    def fetch_ended(self, op_id: int) -> bool: ...

    def elapsed_s(self, op_id: int) -> float: ...

    def write_done(self, op_id: int) -> bool: ...

    def backup_state(self, op_id: int) -> tuple[bool, int]: ...  # (ended, 0 / 1 failed / TIMED_OUT)

    def load_done(self, op_id: int) -> bool: ...

    def idle(self, slots) -> bool: ...


# -- open operations -------------------------------------------------------------


@dataclass
class Prefetch:
    request: PrefetchRequest
    hit: int = NOT_YET  # agreed storage hit; NOT_YET while being asked
    slots: list[int] = field(default_factory=list)
    polled_in: set[int] = field(default_factory=set)  # rounds that carry a termination poll


@dataclass
class Write:
    request: WriteRequest
    new: list[int]  # indexes into request.pages that are not resident yet
    slots: list[int]


@dataclass
class Backup:
    op_id: int
    pages: list[bytes]
    started: bool = False


@dataclass
class Load:
    request: LoadRequest
    slots: list[int]


class CacheState:
    def __init__(self, config: CacheConfig, allocator: PageAllocator, sharding: ShardingSpec, page_size: int):
        self.config = config
        self.allocator = allocator
        self.sharding = sharding
        self.page_size = page_size
        self.index = HostIndex()
        self.prefetches: dict[int, Prefetch] = {}
        self.writes: deque[Write] = deque()
        self.write_ids: set[int] = set()
        self.backups: deque[Backup] = deque()
        self.loads: dict[int, Load] = {}
        self.retiring: dict[int, list[int]] = {}  # retirement id -> slots
        self._next_retirement = 1
        self._next_backup = 1
        self.digest = 0
        self.step = 0
        self.hit_pages = {"host": 0, "storage": 0}  # pages loaded back / prefetched (agreed)

    # -- bookkeeping -------------------------------------------------------------

    def _record(self, *fields) -> None:
        self.digest = hash62(repr((self.digest, fields)).encode())

    def storage_key(self, page: bytes) -> str:
        return self.sharding.storage_key(page.hex())

    def _retire(self, slots: list[int]) -> None:
        if slots:
            self.allocator.retire(slots)
            self.retiring[self._next_retirement] = list(slots)
            self._record("retire", self._next_retirement, tuple(slots))
            self._next_retirement += 1

    def _make_room(self, count: int, keep: set[bytes] = frozenset()) -> bool:
        """Free host slots by evicting least recently used pages; under
        write_back, pages not yet in storage are backed up first instead.
        Evicts nothing when even that would not make room."""
        short = count - self.allocator.free_count
        if short <= 0:
            return True
        write_back = self.config.write_policy == "write_back"

        # Pages used in this step stay: the scheduler was told of them (a
        # Match, an accepted prefetch) and may load them in its next step.
        def skip(page, e):
            return e.last_used >= self.step or page in keep or (write_back and not e.backed_up)

        if self.index.evictable(skip) < short:
            if write_back:
                self._queue_unbacked_for_eviction(short)
            return False
        evicted = self.index.evict(short, skip=skip)
        if evicted:
            # An unreferenced page has no I/O on any rank: loads, backups and
            # writes hold their pages until every rank has finished with them.
            # The exception is a backup that timed out somewhere: its write may
            # still be reading, so those slots wait for an agreed reclaim.
            self._record("evict", tuple(p for p, _ in evicted))
            self.allocator.free([e.slot for _, e in evicted if not e.io_suspect])
            self._retire([e.slot for _, e in evicted if e.io_suspect])
        return self.allocator.free_count >= count

    def _queue_unbacked_for_eviction(self, count: int) -> None:
        queued = {p for b in self.backups for p in b.pages}
        candidates = sorted(
            (e.last_used, page) for page, e in self.index.items()
            if not e.backed_up and not e.refs and page not in queued
        )[:count]
        if candidates:
            self._queue_backup([page for _, page in candidates])

    def _queue_backup(self, pages: list[bytes]) -> None:
        if not pages:
            return
        self.index.ref(pages, +1)
        self.backups.append(Backup(self._next_backup, pages))
        self._record("backup", self._next_backup, tuple(pages))
        self._next_backup += 1

    # -- a scheduler step ----------------------------------------------------------

    def open_step(self, step: int, ops: StepOps) -> tuple[list[Intent], Decisions]:
        """Validate the whole step first (a rejected step opens nothing),
        then open its operations. Returns this rank's I/O to start, and what
        the step decided by itself (scheduler revokes)."""
        self._validate(ops)
        self.step = step
        # Each write gets its own slots (two writes of one page both copy it), so count them all.
        new_pages = sum(1 for req in ops.writes for p in req.pages if p not in self.index)
        loading = {p for req in ops.loads for p in req.pages}
        if not self._make_room(new_pages, keep=loading):
            raise ResourceExhausted(
                f"host pool: writes need {new_pages} new pages; {self.allocator.free_count} of "
                f"{self.allocator.pages} are free and no more can be evicted now"
            )
        intents: list[Intent] = []
        for req in ops.loads:
            intents += self._open_load(req)
        decided = Decisions()
        for op_id in ops.revokes:
            self._revoke(op_id, "revoked by the scheduler", decided)
        for req in ops.prefetches:
            self.prefetches[req.op_id] = Prefetch(req)
            self._record("prefetch", req.op_id, req.pages)
            intents.append(Intent(req.op_id, "exists", keys=tuple(self.storage_key(p) for p in req.pages)))
        for op_id in ops.prefetch_polls:
            self.prefetches[op_id].polled_in.add(step)
        for req in ops.writes:
            intents += self._open_write(req)
        return intents, decided

    def _validate(self, ops: StepOps) -> None:
        seen: set[int] = set()
        for req in (*ops.prefetches, *ops.writes, *ops.loads):
            if req.op_id in seen or req.op_id in self.prefetches or req.op_id in self.write_ids \
                    or req.op_id in self.loads:
                raise InvalidArgument(f"operation {req.op_id} is already open")
            seen.add(req.op_id)
            if not req.pages:
                raise InvalidArgument(f"operation {req.op_id} has no pages")
            if len(req.pages) > MAX_PAGES_PER_OP:
                raise InvalidArgument(f"operation {req.op_id} has {len(req.pages)} pages, at most {MAX_PAGES_PER_OP}")
            if any(len(p) != 32 for p in req.pages):
                raise InvalidArgument(f"operation {req.op_id}: page hashes are 32-byte sha256 digests")
            if not isinstance(req, PrefetchRequest) and len(req.device_pages) != len(req.pages):
                raise InvalidArgument(
                    f"operation {req.op_id}: {len(req.pages)} pages but {len(req.device_pages)} device pages"
                )
        for op_id in (*ops.prefetch_polls, *ops.revokes):
            if op_id not in self.prefetches:
                raise NotFound(f"prefetch {op_id} is not open")
        for req in ops.loads:
            resident = self.index.prefix(list(req.pages))
            if resident < len(req.pages):
                raise NotFound(f"load {req.op_id}: page {resident} ({req.pages[resident].hex()[:16]}) is not in host")

    def _open_write(self, req: WriteRequest) -> list[Intent]:
        new = [i for i, p in enumerate(req.pages) if p not in self.index]  # room was made in open_step
        slots = self.allocator.allocate(len(new))
        self.writes.append(Write(req, new, slots))
        self.write_ids.add(req.op_id)
        self._record("write", req.op_id, req.pages, tuple(slots))
        return [Intent(req.op_id, "write", slots=tuple(slots),
                       device_pages=tuple(req.device_pages[i] for i in new))]

    def _open_load(self, req: LoadRequest) -> list[Intent]:
        pages = list(req.pages)
        slots = [self.index.get(p).slot for p in pages]
        self.index.ref(pages, +1)
        self.index.touch(pages, self.step, hit=True)
        self.loads[req.op_id] = Load(req, slots)
        self.hit_pages["host"] += len(pages)
        self._record("load", req.op_id, req.pages)
        intents = [Intent(req.op_id, "load", slots=tuple(slots), device_pages=req.device_pages)]
        if self.config.write_policy == "write_through_selective":
            hot = [p for p in pages if self.index.get(p).hits == 2 and not self.index.get(p).backed_up]
            self._queue_backup(hot)
        return intents

    # -- a round --------------------------------------------------------------------

    def questions(self, local: LocalProgress) -> Questions:
        """This round's cache questions with this rank's local answers. The set
        depends only on shared state and the step number."""
        ids: list[int] = []
        kinds: list[int] = []
        values: list[int] = []

        def ask(op_id: int, kind: Q, value: int) -> None:
            ids.append(op_id)
            kinds.append(kind)
            values.append(int(value))

        for op_id, pf in self.prefetches.items():
            if pf.hit == NOT_YET:
                ask(op_id, Q.PREFETCH_HIT, local.exists(op_id))
            elif self.step in pf.polled_in:
                done = local.fetched(op_id)
                ask(op_id, Q.PREFETCH_DONE, done)
                ask(op_id, Q.PREFETCH_MAY_END, self._may_end(pf, done, local))
        if self.writes:
            acked = 0
            for w in self.writes:
                if not local.write_done(w.request.op_id):
                    break
                acked += 1
            ask(WRITE_ACK_OP, Q.WRITE_ACK, acked)
        for backup in list(self.backups)[: self.config.backup_window]:
            ended, outcome = local.backup_state(backup.op_id)
            ask(backup.op_id, Q.BACKUP_DONE, ended)
            ask(backup.op_id, Q.BACKUP_FAILED, outcome)
        for op_id in self.loads:
            ask(op_id, Q.LOAD_DONE, local.load_done(op_id))
        for retirement, slots in self.retiring.items():
            ask(retirement, Q.RECLAIM, local.idle(slots))
        reduces = [_REDUCE.get(Q(k), Reduce.MIN) for k in kinds]
        return Questions(
            np.array(ids, dtype=np.int64), np.array(kinds, dtype=np.int64),
            np.array(reduces, dtype=np.int64), np.array(values, dtype=np.int64),
        )

    def open_questions(self) -> int:
        """Operations the next rounds will ask about (upper bound: a prefetch
        asks only when polled)."""
        return (len(self.prefetches) + bool(self.writes) + min(len(self.backups), self.config.backup_window)
                + len(self.loads) + len(self.retiring))

    def _may_end(self, pf: Prefetch, done: int, local: LocalProgress) -> int:
        # Complete: every page is here, or every read has ended (some failed).
        complete = done >= pf.hit or local.fetch_ended(pf.request.op_id)
        policy = self.config.prefetch_policy
        if policy == "best_effort":
            return 1
        if policy == "wait_complete":
            return int(complete)
        return int(complete or local.elapsed_s(pf.request.op_id) > self.config.prefetch_timeout_s(pf.request.tokens))

    def apply(self, result: RoundResult) -> tuple[Decisions, list[Intent]]:
        """Apply an agreed round, in a fixed order. Results about operations
        that have closed since the round was packed are ignored."""
        answers = {(int(o), int(k)): int(v) for o, k, v in zip(result.op_ids, result.kinds, result.values)
                   if k != VOTE.code}
        decisions, intents = Decisions(), []
        for (op_id, kind), value in sorted(answers.items()):
            if kind == Q.PREFETCH_HIT and value != NOT_YET:
                intents += self._decide_hit(op_id, value, decisions)
            elif kind == Q.PREFETCH_MAY_END and value == 1:
                self._end_prefetch(op_id, answers[(op_id, Q.PREFETCH_DONE)], decisions)
            elif kind == Q.WRITE_ACK and value > 0:
                intents += self._ack_writes(value, decisions)
            elif kind == Q.BACKUP_DONE and value == 1:
                self._end_backup(op_id, answers[(op_id, Q.BACKUP_FAILED)], decisions)
            elif kind == Q.LOAD_DONE and value == 1:
                self._end_load(op_id, decisions)
            elif kind == Q.RECLAIM and value == 1 and op_id in self.retiring:
                self.allocator.reclaim(self.retiring.pop(op_id))
                self._record("reclaim", op_id)
        intents += self._start_backups()
        return decisions, intents

    def _decide_hit(self, op_id: int, hit: int, decisions: Decisions) -> list[Intent]:
        pf = self.prefetches.get(op_id)
        if pf is None or pf.hit != NOT_YET:
            return []
        pf.hit = hit
        self._record("hit", op_id, hit)
        decisions.prefetch_hits.append((op_id, hit))
        if hit * self.page_size < self.config.prefetch_threshold_tokens:
            self._revoke(op_id, f"storage hit of {hit * self.page_size} tokens is below the threshold", decisions)
            return []
        if not self._make_room(hit):
            self._revoke(op_id, f"host pool full: {hit} pages do not fit", decisions)
            return []
        pf.slots = self.allocator.allocate(hit)
        self._record("fetch", op_id, tuple(pf.slots))
        keys = tuple(self.storage_key(p) for p in pf.request.pages[:hit])
        return [Intent(op_id, "fetch", keys=keys, slots=tuple(pf.slots), tokens=pf.request.tokens)]

    def _revoke(self, op_id: int, why: str, decisions: Decisions) -> None:
        pf = self.prefetches.pop(op_id)
        self._record("revoke", op_id)
        self._retire(pf.slots)  # back to the allocator once no rank reads into them
        decisions.prefetch_revoked.append((op_id, why))

    def _end_prefetch(self, op_id: int, done: int, decisions: Decisions) -> None:
        pf = self.prefetches.pop(op_id, None)
        if pf is None or pf.hit == NOT_YET:
            return
        pages = list(pf.request.pages[:done])
        kept_pages, kept_slots = [], []
        for page, slot in zip(pages, pf.slots):
            if page in self.index:
                break  # already resident (another operation brought it): keep that copy
            kept_pages.append(page)
            kept_slots.append(slot)
        parent = pf.request.parent
        self.index.insert(kept_pages, kept_slots, parent, self.step)
        for page in kept_pages:
            self.index.get(page).backed_up = True  # it came from storage
        self._record("accept", op_id, len(kept_pages))
        self._retire(pf.slots[len(kept_pages):])  # the unagreed tail, once its reads end
        decisions.prefetch_done.append((op_id, len(kept_pages)))
        self.hit_pages["storage"] += len(kept_pages)

    def _ack_writes(self, count: int, decisions: Decisions) -> list[Intent]:
        for _ in range(min(count, len(self.writes))):
            w = self.writes.popleft()
            self.write_ids.discard(w.request.op_id)
            slot_of = dict(zip(w.new, w.slots))
            inserted, duplicate = [], []
            for i, page in enumerate(w.request.pages):
                slot = slot_of.get(i)
                if slot is None:
                    continue  # was resident when the write opened
                if page in self.index:
                    duplicate.append(slot)  # another operation brought it meanwhile
                    continue
                parent = w.request.pages[i - 1] if i else w.request.parent
                self.index.insert([page], [slot], parent, self.step)
                inserted.append(page)
            self.allocator.free(duplicate)  # acked: every rank's copy into it has ended
            self._record("free", tuple(duplicate))
            self.index.touch([p for p in w.request.pages if p in self.index], self.step)
            self._record("ack", w.request.op_id)
            decisions.write_acks.append(w.request.op_id)
            if self.config.write_policy == "write_through":
                self._queue_backup(inserted)
        return []

    def _start_backups(self) -> list[Intent]:
        """Backups not yet started (they start in the step they are queued)."""
        intents = []
        for backup in self.backups:
            if backup.started:
                continue
            backup.started = True
            slots = tuple(self.index.get(p).slot for p in backup.pages)
            writer = [self.sharding.writes(p.hex()) for p in backup.pages]
            keys = tuple(self.storage_key(p) for p, w in zip(backup.pages, writer) if w)
            mine = tuple(s for s, w in zip(slots, writer) if w)
            intents.append(Intent(backup.op_id, "backup", keys=keys, slots=mine))
        return intents

    def _end_backup(self, op_id: int, outcome: int, decisions: Decisions) -> None:
        backup = next((b for b in self.backups if b.op_id == op_id), None)
        if backup is None:
            return
        self.backups.remove(backup)
        self.index.ref(backup.pages, -1)
        for page in backup.pages:
            entry = self.index.get(page)
            entry.backed_up = outcome == 0
            entry.io_suspect = entry.io_suspect or outcome == TIMED_OUT
        self._record("backed_up", op_id, outcome)
        decisions.backups.append((op_id, outcome == 0))

    def _end_load(self, op_id: int, decisions: Decisions) -> None:
        load = self.loads.pop(op_id, None)
        if load is None:
            return
        self.index.ref(list(load.request.pages), -1)
        self._record("loaded", op_id)
        decisions.loads.append((op_id, len(load.slots)))

    # -- reads --------------------------------------------------------------------------

    def match(self, pages: list[bytes]) -> int:
        return self.index.prefix(pages)

    def stats(self) -> dict:
        return {
            "host_pages_used": len(self.index),
            "host_pages_free": self.allocator.free_count,
            "host_pages_retiring": sum(len(s) for s in self.retiring.values()),
            "open_prefetches": len(self.prefetches),
            "open_writes": len(self.writes),
            "open_backups": len(self.backups),
            "open_loads": len(self.loads),
            "host_hit_pages": self.hit_pages["host"],
            "storage_hit_pages": self.hit_pages["storage"],
        }


def check_step_allowed(attached: bool, ops: StepOps) -> None:
    if not attached and not ops.empty():
        raise FailedPrecondition("no device pool is attached: call Attach before cache operations")
