"""The cache's replicated state machine (docs/design.md §2 and §5).

`CacheState` holds what every rank of a domain must hold identically: the
host index, the page allocator and the table of open operations (its
`Ledger`). It changes only in `open` (a step's operations, once its round
agreed that every rank took the step) and `apply` (an agreed round result).
`check` says whether a step could open, without changing anything, and
`open` checks again first, so a refused step changes nothing (docs/design.md rule 9).
Each operation kind opens, asks and takes its answers in its own module
(`cpcache.state.ops`); this one orders them.

It never does I/O: it emits intents for this rank's data plane and reads this
rank's progress only to fill in the local answers of a round's questions.
Every change is folded into a running digest, so two ranks that applied
anything differently disagree in the next round's header.
"""

from __future__ import annotations

import numpy as np

from cpcache.agreement.kinds import VOTE
from cpcache.agreement.rounds import Questions, RoundResult
from cpcache.config import CacheConfig
from cpcache.errors import CacheError, InvalidArgument, NotFound
from cpcache.keys import ShardingSpec
from cpcache.requests import CacheRequests, LoadRequest, WriteRequest, check_shape
from cpcache.state.allocator import PageAllocator
from cpcache.state.intents import Decisions, Intent
from cpcache.state.ledger import Ledger, LocalProgress, Operation
from cpcache.state.ops import backup, prefetch, prefetch_holds
from cpcache.state.ops.backup import Backup
from cpcache.state.ops.load import Load, open_load
from cpcache.state.ops.prefetch import Prefetch
from cpcache.state.ops.retirement import Retirement, retire
from cpcache.state.ops.write import Write, open_write

# The version of the rules by which agreed rounds change the shared state:
# raised whenever the same rounds could leave it different (2: a chain's
# pages entering out of order count as their parent's children, and an
# accepted prefetch takes the pages after one already resident; 3: an ended
# prefetch may hold its pages; 4: replies count the daemon's own open
# backups, which a scheduler steps for: daemons that do not would have
# their ranks' schedulers step differently).
STATE_RULES = 4


class CacheState:
    def __init__(self, config: CacheConfig, allocator: PageAllocator, sharding: ShardingSpec, page_size: int,
                 device_pages: int) -> None:
        self.ledger = Ledger(config, allocator, sharding, page_size)
        self.device_pages = device_pages
        self.signal_slots = 0  # slots of the attached pool's load-signal board (0: none)

    def carried_over(self, kept: list, busy: list[int]) -> None:
        """A new epoch's start: the pages kept (already restored) enter the
        digest, so ranks that started from different pages disagree at their
        first round; slots still under some rank's I/O wait for a reclaim."""
        self.ledger.record("carried over", tuple((k.page, k.slot) for k in kept), tuple(busy))
        if busy:
            self.ledger.allocator.take(list(busy))
            retire(self.ledger, list(busy))

    # -- a scheduler step ----------------------------------------------------------

    def check(self, requests: CacheRequests, expected_prefetches: set[int] | frozenset[int] = frozenset(),
              loads_resident: bool = True) -> None:
        """Raise the error this step would be refused with; change nothing.
        `expected_prefetches`: prefetches that steps still in the pipeline
        open, which this step may already poll or revoke. Without
        `loads_resident`, a load of pages no longer resident is not the
        step's fault (at lag >= 1 the scheduler learns of evictions late):
        it fails on its own when its step opens."""
        check_shape(requests, self.device_pages, self.signal_slots)
        for req in requests.opened():
            if req.op_id in self.ledger.by_op_id:
                raise InvalidArgument(f"operation {req.op_id} is already open")
        for op_id in (*requests.prefetch_polls, *requests.revokes):
            if prefetch.find(self.ledger, op_id) is None and op_id not in self.ledger.ended_prefetches \
                    and op_id not in expected_prefetches:
                raise NotFound(f"prefetch {op_id} is not open")
        for load in requests.loads if loads_resident else ():
            resident = self.ledger.index.prefix(list(load.pages))
            if resident < len(load.pages):
                raise NotFound(f"load {load.op_id}: page {resident} ({load.pages[resident].hex()[:16]}) is not in host")

    def _keep(self, requests: CacheRequests) -> set[bytes]:
        # The pages a write found resident, and every page a load reads, stay.
        reqs: tuple[WriteRequest | LoadRequest, ...] = (*requests.writes, *requests.loads)
        return {p for req in reqs for p in req.pages}

    def open(self, step: int, requests: CacheRequests,
             keep: set[bytes] | None = None) -> tuple[list[Intent], Decisions]:
        """Open a step's operations, all or none. Returns this rank's I/O to
        start and what the step decided by itself (scheduler revokes).
        `keep`: pages no eviction may take (default: the step's own)."""
        self.check(requests)
        ledger = self.ledger
        ledger.step = step
        prefetch_holds.expire(ledger)
        keep = self._keep(requests) if keep is None else keep
        intents: list[Intent] = []
        decided = Decisions()
        for load in requests.loads:
            intents += open_load(ledger, load)
        for op_id in requests.revokes:
            if (pf := prefetch.find(ledger, op_id)) is not None:
                prefetch.revoke(ledger, pf, "revoked by the scheduler", decided)
            else:  # it ended before the revoke arrived: its request is gone, its hold too
                prefetch_holds.release(ledger, op_id)
        for op_id in requests.hold_releases:
            prefetch_holds.release(ledger, op_id)
        for req in requests.prefetches:
            intents += prefetch.open_prefetch(ledger, req)
        for op_id in requests.prefetch_polls:
            prefetch.poll(ledger, op_id, step)
        for write in requests.writes:
            intents += open_write(ledger, write, keep, decided)
        return intents, decided

    def open_each(self, step: int, requests: CacheRequests) -> tuple[list[Intent], Decisions]:
        """Open a step's operations one at a time, in `open`'s order; one that
        cannot open fails on its own, by op id (a load in load_failures, a
        write in write_failures, a prefetch revoked with the reason). The
        whole step's pages stay, as when it opens as a whole."""
        intents: list[Intent] = []
        decided = Decisions()
        keep = self._keep(requests)
        singles = ([CacheRequests(loads=(r,)) for r in requests.loads]
                   + [CacheRequests(revokes=(i,)) for i in requests.revokes]
                   + [CacheRequests(hold_releases=(i,)) for i in requests.hold_releases]
                   + [CacheRequests(prefetches=(r,)) for r in requests.prefetches]
                   + [CacheRequests(prefetch_polls=(i,)) for i in requests.prefetch_polls]
                   + [CacheRequests(writes=(r,)) for r in requests.writes])
        for single in singles:
            try:
                opened, decisions = self.open(step, single, keep)
            except CacheError as exc:
                for load in single.loads:
                    decided.load_failures.append(load.op_id)
                for write in single.writes:
                    decided.write_failures.append(write.op_id)
                for req in single.prefetches:
                    decided.prefetch_revoked.append((req.op_id, f"cannot open: {exc}"))
                self.ledger.record("refused", step, repr(single))
                continue
            intents += opened
            decided.merge(decisions)
        return intents, decided

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
        for op in self.ledger.open_ops.values():
            if isinstance(op, Backup):
                backups += 1
                if backups > self.ledger.config.backup_window:
                    continue
            for kind, value in op.ask(self.ledger, local):
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
        return self.ledger.take_closed()

    def open_questions(self) -> int:
        """Operations the next rounds may ask about."""
        return len(self.ledger.open_ops)

    def daemon_open(self) -> int:
        """The backups (host -> storage) the daemon opened itself for pages a
        scheduler wrote or loaded, which only later rounds decide, each
        within the storage deadline. Not counted: backups to make room under
        write_back (queued again while storage fails) and retiring slots
        (the next step that needs room reclaims them)."""
        return sum(not b.for_room for b in self.ledger.of_kind(Backup))

    def apply(self, result: RoundResult) -> tuple[Decisions, list[Intent]]:
        """Apply an agreed round, operation by operation in serial order.
        Answers about operations that have closed since are ignored."""
        ledger = self.ledger
        ledger.round = result.number
        answers: dict[int, dict[int, int]] = {}
        for serial, kind, value in zip(result.op_ids.tolist(), result.kinds.tolist(), result.values.tolist()):
            if kind != VOTE.code:
                answers.setdefault(serial, {})[kind] = value
        decisions, intents = Decisions(), []
        for serial in sorted(answers):
            op = ledger.open_ops.get(serial)
            if op is not None:
                intents += op.take_answers(ledger, answers[serial], decisions)
        backup.relieve_pressure(ledger)
        intents += backup.start_queued(ledger)
        return decisions, intents

    # -- reads --------------------------------------------------------------------------

    def match(self, pages: list[bytes]) -> int:
        return self.ledger.index.prefix(pages)

    def stats(self) -> dict[str, int]:
        ledger = self.ledger
        counts = {kind: len(ledger.of_kind(kind)) for kind in (Prefetch, Write, Backup, Load)}
        return {
            "host_pages_used": len(self.ledger.index),
            "host_pages_free": self.ledger.allocator.free_count,
            "host_pages_retiring": sum(len(r.slots) for r in ledger.of_kind(Retirement)),
            "open_prefetches": counts[Prefetch],
            "open_writes": counts[Write],
            "open_backups": counts[Backup],
            "open_loads": counts[Load],
            "host_hit_pages": ledger.hit_pages["host"],
            "storage_hit_pages": ledger.hit_pages["storage"],
            "writes_refused_host_full": ledger.writes_refused,
            "prefetch_held_pages": ledger.held_pages,
            "prefetch_holds_taken": ledger.holds_taken,
            "prefetch_holds_expired": ledger.holds_expired,
            "prefetched_pages_evicted_unloaded": ledger.prefetched_evicted,
            "host_pages_evicted": ledger.host_evicted,
            "prefetch_asked_pages": ledger.prefetch_asked,
            "prefetch_resident_pages": ledger.prefetch_resident,
            "prefetches_short": ledger.prefetches_short,
            "lost_hit_pages_host_evicted": ledger.prefetched_evicted,
            # Pages of a prefetch that ended short: the rank splits them (`CacheRuntime.short_reads`).
            **{f"lost_hit_pages_{reason}": n for reason, n in ledger.lost.items() if reason != "ended_short"},
        }
