"""A cache state driven step by step with scripted I/O, for the example-based
tests of the state machine (tests/unit/state/test_*_op.py, test_ledger.py,
test_cache_state.py).

`ScriptedCache` holds one real `CacheState` (a small host pool, the real
allocator, index and ledger) and N ranks whose I/O does nothing by itself:
each rank answers the cache's questions exactly as the test scripted it
(`ScriptedRank`), so a test says "rank 1's copy of serial 3 failed" and sees
what the agreed MIN of the ranks' answers does. The round is the rank's own,
never a copy of it (tests/unit/rank/test_one_round.py): every rank packs
through `CacheRuntime.pack` (the shared state is one object: every rank holds
it identically), the packed vectors are reduced with MIN, and the agreed
round is applied once through `CacheRuntime.apply_round`, in the stepper's
order: check -> pack (questions of the state *before* the step opens) ->
reduce -> apply (open the step's operations, then take the answers, then
start the queued backups). With `lag`, a step's round is applied `lag` steps
later, as in tests/replicas/harness.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cpcache.agreement.kinds import describe
from cpcache.agreement.rounds import HEADER_SLOTS, MIN_CAPACITY, Questions, RoundInput
from cpcache.config import CacheConfig
from cpcache.errors import CacheError
from cpcache.keys import ShardingSpec
from cpcache.rank.runtime import CacheRuntime
from cpcache.requests import CacheRequests, WriteRequest
from cpcache.state.allocator import PageAllocator
from cpcache.state.host_index import Entry
from cpcache.state.intents import Decisions, Intent
from cpcache.state.ledger import Ledger
from cpcache.state.machine import CacheState
from cpcache.state.questions import NOT_YET, BackupOutcome, CopyOutcome

SHARDING = ShardingSpec()  # one rank's share is every page: a Store's keys and slots are all of its pages
PENDING, FAILED, OK = CopyOutcome.PENDING, CopyOutcome.FAILED, CopyOutcome.OK
# Backups only of pages loaded back twice: a write's ack starts none, so a step shows the write alone.
SELECTIVE = CacheConfig(prefetch_threshold_tokens=0, write_policy="write_through_selective")


def page(n: int) -> bytes:
    """Page hash number `n` (1..255): 32 bytes of n, so hash order is number order."""
    return bytes([n]) * 32


def pages(*ns: int) -> tuple[bytes, ...]:
    return tuple(page(n) for n in ns)


@dataclass
class ScriptedRank:
    """One rank's local I/O (`LocalProgress` and what `CacheRuntime` calls on
    its io): nothing progresses unless the test sets it. By operation serial."""

    lookups: dict[int, int] = field(default_factory=dict)  # pages found in storage (absent: NOT_YET)
    fetched_pages: dict[int, int] = field(default_factory=dict)  # pages fetched so far, from the first
    fetches_ended: set[int] = field(default_factory=set)
    elapsed: dict[int, float] = field(default_factory=dict)
    reads_failed: set[int] = field(default_factory=set)  # fetches a read of which returned short
    writes: dict[int, CopyOutcome] = field(default_factory=dict)
    loads: dict[int, CopyOutcome] = field(default_factory=dict)
    backups: dict[int, BackupOutcome] = field(default_factory=dict)
    busy: set[int] = field(default_factory=set)  # host slots this rank still has I/O on
    started: list[Intent] = field(default_factory=list)
    forgotten: list[int] = field(default_factory=list)

    # What CacheRuntime calls on its io.
    def drain(self) -> None:
        pass

    def start(self, intents: list[Intent]) -> None:
        self.started += intents

    def forget(self, serials: list[int]) -> None:
        self.forgotten += serials

    # LocalProgress.
    def exists(self, serial: int) -> int:
        return self.lookups.get(serial, NOT_YET)

    def fetched(self, serial: int) -> int:
        return self.fetched_pages.get(serial, 0)

    def fetch_ended(self, serial: int) -> bool:
        return serial in self.fetches_ended

    def elapsed_s(self, serial: int) -> float:
        return self.elapsed.get(serial, 0.0)

    def read_failed(self, serial: int) -> bool:
        return serial in self.reads_failed

    def write_outcome(self, serial: int) -> CopyOutcome:
        return self.writes.get(serial, CopyOutcome.PENDING)

    def load_outcome(self, serial: int) -> CopyOutcome:
        return self.loads.get(serial, CopyOutcome.PENDING)

    def backup_outcome(self, serial: int) -> BackupOutcome:
        return self.backups.get(serial, BackupOutcome.PENDING)

    def idle(self, slots: list[int]) -> bool:
        return not set(slots) & self.busy


@dataclass
class Step:
    """What one scheduler step did: the round it applied (its number, and
    the agreed answers as (serial, kind name, value)), the I/O it started,
    what it decided, whether its operations opened one by one, and the
    state's digest after it."""

    number: int
    applied: int
    answers: list[tuple[int, str, int]]
    intents: list[Intent]
    decided: Decisions
    refused: CacheError | None
    digest: int
    rejected: CacheError | None = None  # lag >= 1: why the ranks refused this step (nothing of it applies)


@dataclass
class _Pending:
    number: int
    requests: CacheRequests
    inputs: list[RoundInput] | None  # None: the ranks refused the step (a rejected round)


class ScriptedCache:
    def __init__(self, config: CacheConfig | None = None, host_pages: int = 4, ranks: int = 2, page_size: int = 16,
                 device_pages: int = 16, lag: int = 0) -> None:
        # best_effort without its wait by default: a poll ends a prefetch then and there.
        config = config or CacheConfig(prefetch_threshold_tokens=0, prefetch_best_effort_wait_s=0.0)
        self.state = CacheState(config, PageAllocator(host_pages),
                                SHARDING, page_size, device_pages)
        self.ranks = [ScriptedRank() for _ in range(ranks)]
        self.runtimes = [CacheRuntime(self.state, rank) for rank in self.ranks]  # type: ignore[arg-type]
        self.lag = lag
        self.number = 0
        self.capacity = MIN_CAPACITY
        self.pipeline: list[_Pending] = []
        self.digests: list[int] = []  # the digest after each step, refused ones included

    # -- scripting the ranks' I/O ---------------------------------------------------------

    def answer(self, table: str, serial: int, *values: object) -> None:
        """Rank r answers values[r] about `serial` in its `table` (a field of
        ScriptedRank); a single value: every rank answers it."""
        assert len(values) in (1, len(self.ranks)), "one value, or one per rank"
        for r, rank in enumerate(self.ranks):
            getattr(rank, table)[serial] = values[0] if len(values) == 1 else values[r]

    def fetch_ends(self, serial: int, *fetched: int) -> None:
        """The fetch of `serial` ended on every rank, with these pages done."""
        self.answer("fetched_pages", serial, *fetched)
        for rank in self.ranks:
            rank.fetches_ended.add(serial)

    # -- stepping ---------------------------------------------------------------------------

    def step(self, requests: CacheRequests | None = None) -> Step:
        """One scheduler step on every rank: apply the round due now (at lag
        0 this step's own), after checking and packing this step's. A step
        the ranks refuse enters its round as a rejection, and nothing of it
        ever applies: at lag 0 its error is raised here; at lag >= 1 it is
        returned in `Step.rejected` (the round applied in the step still
        applies)."""
        requests = requests if requests is not None else CacheRequests()
        self.number += 1
        try:
            return self._step(self.number, requests)
        finally:
            self.digests.append(self.ledger.digest)

    def _step(self, number: int, requests: CacheRequests) -> Step:
        step = Step(number, 0, [], [], Decisions(), None, self.ledger.digest)
        if self.lag and len(self.pipeline) >= self.lag:
            step = self._apply(number, self.pipeline.pop(0))
        in_pipeline = [p.requests for p in self.pipeline if p.inputs is not None]
        try:
            self.runtimes[0].check(requests, in_pipeline, loads_resident=not self.lag)
        except CacheError as exc:
            if not self.lag:
                raise
            self.pipeline.append(_Pending(number, requests, None))
            step.rejected = exc
            return step
        inputs = [rt.pack(number, Questions.empty(), self.ledger.digest, requests) for rt in self.runtimes]
        self.pipeline.append(_Pending(number, requests, inputs))
        if not self.lag:
            step = self._apply(number, self.pipeline.pop(0))
        return step

    def _apply(self, number: int, pending: _Pending) -> Step:
        if pending.inputs is None:  # a rejected round: nothing of it applies
            return Step(number, pending.number, [], [], Decisions(), None, self.ledger.digest)
        result = pending.inputs[0].decode(self._reduce(pending.inputs))
        started: list[Intent] = []
        done = self.runtimes[0].apply_round(pending.number, pending.requests, result, started.extend)
        intents = started + done.later
        for rank in self.ranks:
            rank.start(intents)
        answers = [(int(s), describe(int(k)), int(v)) for s, k, v in zip(result.op_ids, result.kinds, result.values)]
        return Step(number, pending.number, answers, intents, done.decided, done.refused, self.ledger.digest)

    def _reduce(self, inputs: list[RoundInput]) -> np.ndarray:
        def reduce_min(vec: np.ndarray) -> None:
            vec[:] = np.minimum.reduce([inp.framed(len(vec) - HEADER_SLOTS) for inp in inputs])

        vec, self.capacity = inputs[0].reduce(reduce_min, self.capacity)
        return vec

    def write_and_ack(self, op_id: int, *ns: int, parent: bytes | None = None) -> tuple[Step, Step]:
        """Two steps: write pages `ns` (from device pages 0, 1, ...), then
        acknowledge it, every rank's copy having ended well."""
        opened = self.step(CacheRequests(writes=(WriteRequest(op_id, pages(*ns), tuple(range(len(ns))), parent),)))
        self.answer("writes", self.ledger.by_op_id[op_id], CopyOutcome.OK)
        acked = self.step()
        assert op_id in acked.decided.write_acks
        return opened, acked

    # -- reads ------------------------------------------------------------------------------

    @property
    def ledger(self) -> Ledger:
        """The shared state's ledger: index, allocator, open operations, digest."""
        return self.state.ledger

    @property
    def digest(self) -> int:
        return self.ledger.digest

    def slots(self) -> dict[bytes, int]:
        """Resident page -> its host slot."""
        return {p: e.slot for p, e in self.ledger.index.items()}

    def entry(self, n: int) -> Entry:
        return self.ledger.index[page(n)]

    def pool(self) -> tuple[list[int], list[int], list[int]]:
        """(free, allocated, retiring) host slots, each sorted."""
        alloc = self.ledger.allocator
        return sorted(alloc.free_slots), sorted(alloc.allocated), sorted(alloc.retiring)

    def open_ops(self) -> list[str]:
        return [f"{serial}: {op.label()}" for serial, op in self.ledger.open_ops.items()]


