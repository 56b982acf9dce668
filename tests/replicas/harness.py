"""A replica-level harness (DESIGN section 11): N in-process replicas of the
replicated cache state machine and its round path over an in-process MIN,
each with a fake local I/O whose completion, delay and failure the test
controls. `Domain.step` drives one scheduler step the way
`cpcache.rank.stepper.Stepper` does (check -> pack or rejected -> reduce ->
settle; on agreement open then apply; lag 0 to 3) and checks the
invariants after it."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from cpcache.agreement.rounds import MIN_CAPACITY, RoundInput, RoundResult, next_capacity
from cpcache.config import CacheConfig
from cpcache.errors import CacheError
from cpcache.keys import ShardingSpec
from cpcache.state.allocator import PageAllocator
from cpcache.state.intents import CopyToDevice, CopyToHost, Decisions, Fetch, Lookup, Store
from cpcache.state.machine import CacheState
from cpcache.state.operations import Prefetch
from cpcache.state.questions import NOT_YET, BackupOutcome, Outcome
from cpcache.state.requests import StepOps


class InvariantViolation(AssertionError):
    pass


@dataclass
class IOPlan:
    """How one replica's I/O behaves: delays in steps, failure rates."""

    seed: int = 0
    max_delay: int = 2
    fail_rate: float = 0.0
    timeout_rate: float = 0.0  # stores that time out (and keep reading a while)
    storage_hit: float = 1.0  # chance that a lookup finds every page (else a random prefix)


@dataclass
class Job:
    kind: str
    serial: int
    slots: tuple[int, ...]
    remaining: int  # steps until it ends
    fail: bool = False
    size: int = 0  # pages (fetch) / storage hit (lookup)
    done: int = 0  # fetch: pages done so far
    ended: bool = False
    started: int = 0
    linger: int = 0  # a timed-out store keeps reading this many steps after it reported
    timed_out: bool = False

    def busy_slots(self) -> tuple[int, ...]:
        if self.ended and self.linger <= 0:
            return ()
        if self.kind == "fetch" and not self.ended:
            return self.slots[self.done:]
        return self.slots


class FakeIO:
    """One replica's local I/O, implementing `LocalProgress`, fed by intents."""

    def __init__(self, plan: IOPlan) -> None:
        self.plan = plan
        self.rng = random.Random(plan.seed)
        self.jobs: dict[int, Job] = {}  # by serial: the one data job of an operation
        self.lookups: dict[int, Job] = {}  # by serial: storage lookups (no slots)
        self.now = 0
        self.draining = False  # every job ends at once, none fails or times out

    def _delay(self) -> int:
        return 0 if self.draining else self.rng.randint(0, self.plan.max_delay)

    def _fails(self) -> bool:
        return not self.draining and self.rng.random() < self.plan.fail_rate

    def start(self, intents: list) -> None:
        for intent in intents:
            table = self.lookups if isinstance(intent, Lookup) else self.jobs
            assert intent.serial not in table, f"serial {intent.serial} started twice"
            match intent:
                case Lookup():
                    n = len(intent.keys)
                    hit = n if self.rng.random() < self.plan.storage_hit else self.rng.randint(0, n)
                    job = Job("lookup", intent.serial, (), self._delay(), size=hit)
                case Fetch():
                    job = Job("fetch", intent.serial, intent.slots, self._delay(), self._fails(),
                              size=len(intent.slots))
                case CopyToHost():
                    job = Job("to_host", intent.serial, intent.slots, self._delay(), self._fails())
                case Store():
                    job = Job("store", intent.serial, intent.slots, self._delay(), self._fails())
                    if not self.draining and self.rng.random() < self.plan.timeout_rate:
                        job.timed_out, job.linger = True, self.rng.randint(1, 4)
                case CopyToDevice():
                    job = Job("to_device", intent.serial, intent.slots, self._delay(), self._fails())
                case _:
                    raise AssertionError(f"unknown intent {intent!r}")
            job.started = self.now
            table[intent.serial] = job
            if job.remaining == 0:
                self._end(job)

    def _end(self, job: Job) -> None:
        job.ended = True
        if job.kind == "fetch":
            job.done = self.rng.randint(0, job.size) if job.fail else job.size

    def tick(self) -> None:
        """One step of time passes."""
        self.now += 1
        for job in (*self.jobs.values(), *self.lookups.values()):
            if job.ended:
                if job.linger > 0:
                    job.linger = 0 if self.draining else job.linger - 1
                continue
            if self.draining:
                job.remaining = 0
            else:
                job.remaining -= 1
                if job.kind == "fetch" and not job.fail and job.done < job.size:
                    job.done += 1
            if job.remaining <= 0:
                self._end(job)

    def drain(self) -> None:
        self.draining = True
        for job in (*self.jobs.values(), *self.lookups.values()):
            if not job.ended:
                self._end(job)
            job.linger = 0

    def forget(self, serials: list[int]) -> None:
        pass  # jobs are kept: the harness checks their history

    # -- LocalProgress ---------------------------------------------------------------

    def exists(self, serial: int) -> int:
        job = self.lookups.get(serial)
        return job.size if job is not None and job.ended else NOT_YET

    def fetched(self, serial: int) -> int:
        job = self.jobs.get(serial)
        return job.done if job else 0

    def fetch_ended(self, serial: int) -> bool:
        job = self.jobs.get(serial)
        return job is None or job.ended

    def elapsed_s(self, serial: int) -> float:
        job = self.jobs.get(serial)
        return float(self.now - job.started) if job else 0.0

    def _outcome(self, serial: int) -> Outcome:
        job = self.jobs.get(serial)
        if job is None or not job.ended:
            return Outcome.PENDING
        return Outcome.FAILED if job.fail else Outcome.OK

    def write_outcome(self, serial: int) -> Outcome:
        return self._outcome(serial)

    def load_outcome(self, serial: int) -> Outcome:
        return self._outcome(serial)

    def backup_outcome(self, serial: int) -> BackupOutcome:
        job = self.jobs.get(serial)
        if job is None or not job.ended:
            return BackupOutcome.PENDING
        if job.timed_out:
            return BackupOutcome.TIMED_OUT
        return BackupOutcome.FAILED if job.fail else BackupOutcome.STORED

    def idle(self, slots: list[int]) -> bool:
        return not (set(slots) & self.busy())

    def busy(self) -> set[int]:
        return {s for job in self.jobs.values() for s in job.busy_slots()}


@dataclass
class Replica:
    rank: int
    state: CacheState
    io: FakeIO


@dataclass
class Pending:
    """A round reduced but not yet applied (lag >= 1)."""

    number: int
    ops: StepOps
    inputs: list[RoundInput]
    reduced: np.ndarray


@dataclass
class StepReport:
    number: int
    rejected: bool = False  # the round applied in this step was rejected
    refused: bool = False  # agreed, but open refused it (same error on every rank)
    decisions: Decisions = field(default_factory=Decisions)
    applied: int = 0  # the round number applied in this step (0: none yet)


def make_state(config: CacheConfig, host_pages: int, page_size: int, device_pages: int) -> CacheState:
    return CacheState(config, PageAllocator(host_pages), ShardingSpec(), page_size, device_pages)


class Domain:
    """N replicas stepped together over an in-process MIN."""

    def __init__(self, plans: list[IOPlan], config: CacheConfig, host_pages: int = 12, page_size: int = 16,
                 device_pages: int = 64, lag: int = 0) -> None:
        self.replicas = [Replica(r, make_state(config, host_pages, page_size, device_pages), FakeIO(p))
                         for r, p in enumerate(plans)]
        self.lag = lag
        self.capacity = MIN_CAPACITY  # agreed: every replica computes the same
        self.pipeline: list[Pending] = []
        self.number = 0
        self.history: list[tuple[int, StepOps, int | None]] = []  # (step, ops, injected rejecting rank)
        self.write_serials: dict[int, int] = {}  # write op id -> serial of its CopyToHost (latest)
        self.mirror: set[bytes] = set()  # the host pool as the replies tell it (what the SGLang backend keeps)

    @property
    def lead(self) -> CacheState:
        return self.replicas[0].state

    # -- the round path -----------------------------------------------------------

    def _pack(self, number: int, ops: StepOps, reject_rank: int | None) -> list[RoundInput]:
        inputs = []
        for rep in self.replicas:
            try:
                # As the stepper checks: at lag >= 1 a load of pages gone since is not refused.
                rep.state.check(ops, loads_resident=not self.lag)
                refusal = None
            except CacheError as exc:
                refusal = exc
            if refusal is None and reject_rank == rep.rank:
                refusal = CacheError("injected one-replica rejection")
                refusal.status = "UNAVAILABLE"
            if refusal is not None:
                inputs.append(RoundInput.rejected(number, rep.rank, refusal.status, str(refusal)))
            else:
                questions, labels = rep.state.questions(rep.io)
                inputs.append(RoundInput.pack(number, questions, rep.state.digest, hash(repr(ops)) & (2**62 - 1),
                                              labels))
        return inputs

    def _reduce(self, inputs: list[RoundInput]) -> np.ndarray:
        """RoundInput.reduce on every replica, with a MIN over all of them."""
        # Every replica frames at the same agreed capacity; the MIN callback of
        # the collective is emulated by reducing all replicas' framed vectors.
        framed = [inp._framed(self.capacity) for inp in inputs]
        reduced = np.minimum.reduce(framed)
        agreed = int(-reduced[4])
        if agreed > self.capacity:
            cap = next_capacity(agreed)
            reduced = np.minimum.reduce([inp._framed(cap) for inp in inputs])
        # And through RoundInput.reduce itself, to check it agrees.
        results = []
        for inp in inputs:
            def reduce_min(vec: np.ndarray, _inputs=inputs) -> None:
                cap = len(vec) - 7
                vec[:] = np.minimum.reduce([i._framed(cap) for i in _inputs])
            vec, next_cap = inp.reduce(reduce_min, self.capacity)
            results.append((vec, next_cap))
        for vec, next_cap in results:
            if not np.array_equal(vec, reduced) or next_cap != results[0][1]:
                raise InvariantViolation("replicas reduced differently")
        self.capacity = results[0][1]
        return reduced

    def _apply(self, pending: Pending, report: StepReport) -> None:
        before = [rep.state.digest for rep in self.replicas]
        results: list[RoundResult] = [inp.settle(pending.reduced) for inp in pending.inputs]
        report.applied = pending.number
        if results[0].rejection is not None:
            if any(r.rejection is None for r in results):
                raise InvariantViolation("a round read as rejected on some replicas only")
            report.rejected = True
            after = [rep.state.digest for rep in self.replicas]
            if after != before:
                raise InvariantViolation(f"rejected round {pending.number} changed a digest")
            return
        decided: list[Decisions] = []
        errors: list[str | None] = []
        new_intents: list[list] = []
        for rep, result in zip(self.replicas, results):
            intents, decisions, error = [], Decisions(), None
            if not pending.ops.empty():
                try:
                    intents, decisions = rep.state.open(pending.number, pending.ops)
                except CacheError as exc:
                    # As the stepper does: each operation opens or fails on its own.
                    error = f"{type(exc).__name__}: {exc}"
                    intents, decisions = rep.state.open_each(pending.number, pending.ops)
            errors.append(error)
            new_intents.append(list(intents))
            more_decisions, more = rep.state.apply(result)
            decisions.merge(more_decisions)
            # As the stepper does: the reply tells how the host pool changed.
            decisions.host_entered, decisions.host_left = rep.state.index.take_changes()
            new_intents[-1] += more
            decided.append(decisions)
        if len(set(errors)) != 1:
            raise InvariantViolation(f"open raised differently across replicas: {errors}")
        report.refused = errors[0] is not None
        for rep, intents in zip(self.replicas, new_intents):
            self._check_slots(rep, intents)
        for rep, intents in zip(self.replicas, new_intents):
            rep.io.start(intents)
            rep.io.forget(rep.state.closed)
            rep.state.closed.clear()
        reprs = {repr(d) for d in decided}
        if len(reprs) != 1:
            raise InvariantViolation(f"decisions differ: {reprs}")
        report.decisions = decided[0]
        self._check_acks(report.decisions)
        self._check_mirror(report.decisions)

    def _check_mirror(self, decisions: Decisions) -> None:
        """A scheduler that follows the replies' host_entered / host_left
        holds exactly the pages resident in the host pool."""
        self.mirror.difference_update(decisions.host_left)
        self.mirror.update(decisions.host_entered)
        resident = {page for page, _ in self.lead.index.items()}
        if self.mirror != resident:
            raise InvariantViolation(f"after round {self.number}: the replies' host changes give "
                                     f"{len(self.mirror)} pages, the host pool holds {len(resident)} "
                                     f"({len(self.mirror ^ resident)} differ)")

    def _check_slots(self, rep: Replica, intents: list) -> None:
        """No slot is handed out to a new write or fetch while any replica
        still has I/O on it."""
        busy = set().union(*(r.io.busy() for r in self.replicas))
        for intent in intents:
            if isinstance(intent, CopyToHost):
                op = rep.state.ops.get(intent.serial)
                if op is not None:
                    self.write_serials[op.request.op_id] = intent.serial
            if isinstance(intent, (CopyToHost, Fetch)):
                clash = set(intent.slots) & busy
                if clash:
                    raise InvariantViolation(
                        f"replica {rep.rank}: {type(intent).__name__} {intent.serial} got slots {sorted(clash)} "
                        f"that still have I/O in flight")

    def _check_acks(self, decisions: Decisions) -> None:
        for op_id in decisions.write_acks:
            serial = self.write_serials.get(op_id)
            if serial is None:
                continue  # every page was resident: nothing to copy
            for rep in self.replicas:
                job = rep.io.jobs.get(serial)
                if job is None or not job.ended or job.fail:
                    raise InvariantViolation(f"write {op_id} acknowledged before replica {rep.rank}'s copy ended well")

    def step(self, ops: StepOps, reject_rank: int | None = None) -> StepReport:
        """One scheduler step on every replica."""
        self.number += 1
        number = self.number
        self.history.append((number, ops, reject_rank))
        for rep in self.replicas:
            rep.io.tick()
        report = StepReport(number)
        if self.lag and len(self.pipeline) >= self.lag:
            self._apply(self.pipeline.pop(0), report)
        inputs = self._pack(number, ops, reject_rank)
        self.pipeline.append(Pending(number, ops, inputs, self._reduce(inputs)))
        if not self.lag:
            self._apply(self.pipeline.pop(0), report)
        self.check_shared()
        return report

    def check_shared(self) -> None:
        digests = {rep.state.digest for rep in self.replicas}
        if len(digests) != 1:
            raise InvariantViolation(f"digests differ after step {self.number}: {digests}")
        for rep in self.replicas:
            st = rep.state
            alloc = st.allocator
            index_slots = [e.slot for _, e in st.index.items()]
            if len(set(index_slots)) != len(index_slots):
                raise InvariantViolation(f"replica {rep.rank}: two resident pages share a slot")
            if not set(index_slots) <= alloc._allocated:
                raise InvariantViolation(f"replica {rep.rank}: a resident page's slot is not allocated")
            free = set(alloc._free)
            if free & (alloc._allocated | alloc._retiring) or len(free) != len(alloc._free):
                raise InvariantViolation(f"replica {rep.rank}: allocator sets overlap")
            if len(free) + len(alloc._allocated) + len(alloc._retiring) != alloc.pages:
                raise InvariantViolation(f"replica {rep.rank}: allocator lost slots")

    def open_prefetch_ids(self) -> list[int]:
        return sorted(op.request.op_id for op in self.lead.ops.values() if isinstance(op, Prefetch))

    def settle_all(self, max_steps: int = 40) -> int:
        """Complete every I/O and step (polling every open prefetch) until no
        operation is open. Returns the steps it took."""
        for rep in self.replicas:
            rep.io.drain()
        for i in range(max_steps):
            if not self.lead.ops and not any(p.ops.opened() for p in self.pipeline):
                return i
            self.step(StepOps(prefetch_polls=tuple(self.open_prefetch_ids())) if i % 2 == 0 else StepOps())
        raise InvariantViolation(f"operations still open after {max_steps} idle steps with all I/O ended: "
                                 f"{[op.label() for op in self.lead.ops.values()]}")

    def check_quiescent(self) -> None:
        for rep in self.replicas:
            st = rep.state
            if st.ops or st.by_op_id:
                raise InvariantViolation(f"replica {rep.rank}: open operations remain: {list(st.ops)}")
            index_slots = {e.slot for _, e in st.index.items()}
            if st.allocator._allocated != index_slots or st.allocator._retiring:
                raise InvariantViolation(
                    f"replica {rep.rank}: allocated {sorted(st.allocator._allocated)} but resident "
                    f"{sorted(index_slots)}, retiring {sorted(st.allocator._retiring)}")
