"""The ledger every operation kind opens, and takes its answers, against: the host
index, the page allocator, the digest of every change and the table of open
operations. Shared state: identical on every rank of a domain, changed only
in a step's opening and a round's applying (`machine.CacheState`).

Operations are keyed by a serial the ledger hands out when they open:
unique for the life of the state and never reused, so an answer can only
ever reach the operation it was asked about, whatever the lag.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Protocol, TypeVar

from cpcache.agreement.kinds import QuestionKind
from cpcache.config import CacheConfig
from cpcache.hashing import hash62
from cpcache.keys import ShardingSpec
from cpcache.state.allocator import PageAllocator
from cpcache.state.host_index import HostIndex
from cpcache.state.intents import Decisions, Intent, Store
from cpcache.state.policies import prefetch_policy, write_policy
from cpcache.state.questions import BackupOutcome, CopyOutcome

Asked = list[tuple[QuestionKind, int]]
# Why pages a prefetch asked for did not enter the host pool: not in storage;
# a hit revoked below the threshold, for want of host room, or by the
# scheduler; a hit whose prefetch ended before they were read (the rank
# tells late reads from failed ones: `take_short`).
LOST_REASONS = ("storage_miss", "below_threshold", "host_full", "revoked", "ended_short")


@dataclass(frozen=True)
class Hold:
    """An ended prefetch's pages, kept from eviction since `step`."""

    step: int
    pages: tuple[bytes, ...]


class LocalProgress(Protocol):
    """This rank's I/O progress by operation serial, read when a round is packed."""

    def exists(self, serial: int) -> int: ...  # NOT_YET until known

    def fetched(self, serial: int) -> int: ...  # pages done, from the first

    def fetch_ended(self, serial: int) -> bool: ...

    def elapsed_s(self, serial: int) -> float: ...

    def write_outcome(self, serial: int) -> CopyOutcome: ...

    def backup_outcome(self, serial: int) -> BackupOutcome: ...

    def load_outcome(self, serial: int) -> CopyOutcome: ...

    def idle(self, slots: list[int]) -> bool: ...


class Operation:
    """An open operation: the questions it asks each round (with this
    rank's local answers), and what it does with the agreed answers. Each
    kind lives in one module of `cpcache.state.ops`, with its opening."""

    serial: int

    def label(self) -> str:
        raise NotImplementedError

    def ask(self, ledger: Ledger, local: LocalProgress) -> Asked:
        raise NotImplementedError

    def take_answers(self, ledger: Ledger, answers: dict[int, int], decisions: Decisions) -> list[Intent]:
        raise NotImplementedError


OpT = TypeVar("OpT", bound=Operation)


class Ledger:
    def __init__(self, config: CacheConfig, allocator: PageAllocator, sharding: ShardingSpec, page_size: int) -> None:
        self.config = config
        self.prefetch_policy = prefetch_policy(config)
        self.write_policy = write_policy(config)
        self.allocator = allocator
        self.sharding = sharding
        self.page_size = page_size
        self.index = HostIndex(track_unbacked=self.write_policy.backup_before_evict)
        self.open_ops: dict[int, Operation] = {}  # by serial; insertion order is serial order
        self.by_op_id: dict[int, int] = {}  # the scheduler's op id -> serial, for open prefetches, writes, loads
        # Prefetches that ended lately: a poll or revoke of one is a race the
        # scheduler cannot avoid at lag >= 1 (it learns of the end later), so
        # it is taken and ignored rather than refused.
        self.ended_prefetches: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._closed: list[int] = []  # serials closed since the data plane last forgot them
        self.stores: list[Store] = []  # backups queued in the round being applied, started at its end
        self.digest = 0
        self.step = 0  # the step whose operations opened last
        self.round = 0  # the round applied last
        self.hit_pages = {"host": 0, "storage": 0}  # pages loaded back / prefetched (agreed)
        self.writes_refused = 0  # write-throughs refused for want of evictable host pages
        # Ended prefetches keeping their pages for their request, in the
        # order they ended (`ops.prefetch_holds`), and what that holds.
        self.holds: collections.OrderedDict[int, Hold] = collections.OrderedDict()
        self.hold_cap = int(config.prefetch_hold_share * allocator.pages)
        self.held_pages = 0  # pages some hold keeps (each counted once)
        self.holds_taken = 0
        self.holds_expired = 0
        self.prefetched_evicted = 0  # prefetched pages evicted before any load read them
        # Pages prefetches asked for, and why those that did not enter the
        # host pool did not (`ops.prefetch`: LOST_REASONS); agreed, like the hits.
        self.prefetch_asked = 0
        self.prefetch_resident = 0  # read, but resident already by another operation: kept that copy
        self.lost: dict[str, int] = dict.fromkeys(LOST_REASONS, 0)
        self.prefetches_short = 0  # prefetches that ended before every page of their hit was read
        # (serial, pages) of each prefetch that ended short, for this rank to
        # tell a late read from a failed one (`take_short`).
        self._short: list[tuple[int, int]] = []
        self.host_evicted = 0  # pages evicted from the host pool to make room
        self._next_serial = 1

    def record(self, *fields: object) -> None:
        """Fold one change into the digest. Page lists are hashed as their
        bytes (a repr of each would cost more than the change itself)."""
        parts = [self.digest.to_bytes(8, "little")]
        for f in fields:
            if isinstance(f, tuple | list) and f and isinstance(f[0], bytes):
                parts.append(b"".join(f))
            else:
                parts.append(repr(f).encode())
        self.digest = hash62(b"\x1f".join(parts))

    def serial(self) -> int:
        serial = self._next_serial
        self._next_serial += 1
        return serial

    def add(self, op: Operation, op_id: int | None = None) -> None:
        """Open `op`; `op_id`: the scheduler's id for it, if it has one."""
        self.open_ops[op.serial] = op
        if op_id is not None:
            self.by_op_id[op_id] = op.serial

    def close(self, op: Operation, op_id: int | None = None) -> None:
        del self.open_ops[op.serial]
        self._closed.append(op.serial)
        if op_id is not None:
            del self.by_op_id[op_id]

    def ended_short(self, serial: int, pages: int) -> None:
        """A prefetch ended with `pages` of its hit unread."""
        self.lost["ended_short"] += pages
        self.prefetches_short += 1
        self._short.append((serial, pages))

    def take_short(self) -> list[tuple[int, int]]:
        """The prefetches that ended short since the last call (each told once)."""
        short, self._short = self._short, []
        return short

    def take_closed(self) -> list[int]:
        """The serials closed since the last call (each told once)."""
        closed, self._closed = self._closed, []
        return closed

    def find(self, op_id: int, kind: type[OpT]) -> OpT | None:
        """The open operation of `kind` the scheduler calls `op_id`, if any."""
        op = self.open_ops.get(self.by_op_id.get(op_id, 0))
        return op if isinstance(op, kind) else None

    def of_kind(self, kind: type[OpT]) -> list[OpT]:
        return [op for op in self.open_ops.values() if isinstance(op, kind)]
