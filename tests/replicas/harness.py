"""A replica-level harness (docs/design.md §11): N in-process copies of one
rank's cache (`cpcache.rank.runtime.CacheRuntime`: the shared state and its
round) over an in-process MIN, each with a fake local I/O whose completion,
delay and failure the test controls. `Domain.step` drives one scheduler
step in the stepper's order (check -> pack or rejected -> reduce -> decode;
on agreement the rank's own `apply_round`; lag 0 to 3) and checks the
invariants after it. The round itself is the rank's, never a copy of it
(tests/unit/rank/test_one_round.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cpcache.agreement.rounds import MIN_CAPACITY, Questions, RoundInput, RoundResult, next_capacity
from cpcache.config import CacheConfig
from cpcache.errors import CacheError
from cpcache.keys import ShardingSpec
from cpcache.rank.runtime import CacheRuntime
from cpcache.requests import CacheRequests
from cpcache.state.allocator import PageAllocator
from cpcache.state.intents import CopyToHost, Decisions, Fetch, Intent
from cpcache.state.machine import CacheState
from cpcache.state.ops.prefetch import Prefetch
from tests.support.fakes import FakeIO, IOPlan


class InvariantViolation(AssertionError):
    pass


@dataclass
class Replica:
    rank: int
    runtime: CacheRuntime  # its io is a FakeIO

    @property
    def state(self) -> CacheState:
        return self.runtime.state

    @property
    def io(self) -> FakeIO:
        return self.runtime.io


@dataclass
class Pending:
    """A round reduced but not yet applied (lag >= 1)."""

    number: int
    requests: CacheRequests
    taken: list[CacheRequests | None]  # by replica: the step as it took it, None where it refused it
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
        self.replicas = [Replica(r, CacheRuntime(make_state(config, host_pages, page_size, device_pages),
                                                 FakeIO(p)))
                         for r, p in enumerate(plans)]
        self.lag = lag
        self.capacity = MIN_CAPACITY  # agreed: every replica computes the same
        self.pipeline: list[Pending] = []
        self.number = 0
        self.history: list[tuple[int, CacheRequests, int | None]] = []  # (step, requests, injected rejecting rank)
        self.write_serials: dict[int, int] = {}  # write op id -> serial of its CopyToHost (latest)
        self.mirror: set[bytes] = set()  # the host pool as the replies tell it (what the SGLang backend keeps)

    @property
    def lead(self) -> CacheState:
        return self.replicas[0].state

    # -- the round path -----------------------------------------------------------

    def _pack(self, number: int, requests: CacheRequests, reject_rank: int | None) -> tuple[list[RoundInput], list]:
        inputs, taken = [], []
        for rep in self.replicas:
            in_pipeline = [p.taken[rep.rank] for p in self.pipeline if p.taken[rep.rank] is not None]
            try:
                rep.runtime.check(requests, in_pipeline, loads_resident=not self.lag)
                refusal = None
            except CacheError as exc:
                refusal = exc
            if refusal is None and reject_rank == rep.rank:
                refusal = CacheError("injected one-replica rejection")
                refusal.status = "UNAVAILABLE"
            if refusal is not None:
                inputs.append(RoundInput.rejected(number, rep.rank, refusal.status, str(refusal)))
            else:
                inputs.append(rep.runtime.pack(number, Questions.empty(), rep.state.ledger.digest, requests))
            taken.append(None if refusal else requests)
        return inputs, taken

    def _reduce(self, inputs: list[RoundInput]) -> np.ndarray:
        """RoundInput.reduce on every replica, with a MIN over all of them."""
        # Every replica frames at the same agreed capacity; the MIN callback of
        # the collective is emulated by reducing all replicas' framed vectors.
        framed = [inp.framed(self.capacity) for inp in inputs]
        reduced = np.minimum.reduce(framed)
        agreed = int(-reduced[4])
        if agreed > self.capacity:
            cap = next_capacity(agreed)
            reduced = np.minimum.reduce([inp.framed(cap) for inp in inputs])
        # And through RoundInput.reduce itself, to check it agrees.
        results = []
        for inp in inputs:
            def reduce_min(vec: np.ndarray, _inputs=inputs) -> None:
                cap = len(vec) - 7
                vec[:] = np.minimum.reduce([i.framed(cap) for i in _inputs])
            vec, next_cap = inp.reduce(reduce_min, self.capacity)
            results.append((vec, next_cap))
        for vec, next_cap in results:
            if not np.array_equal(vec, reduced) or next_cap != results[0][1]:
                raise InvariantViolation("replicas reduced differently")
        self.capacity = results[0][1]
        return reduced

    def _apply(self, pending: Pending, report: StepReport) -> None:
        before = [rep.state.ledger.digest for rep in self.replicas]
        results: list[RoundResult] = [inp.decode(pending.reduced) for inp in pending.inputs]
        report.applied = pending.number
        if results[0].rejection is not None:
            if any(r.rejection is None for r in results):
                raise InvariantViolation("a round read as rejected on some replicas only")
            report.rejected = True
            after = [rep.state.ledger.digest for rep in self.replicas]
            if after != before:
                raise InvariantViolation(f"rejected round {pending.number} changed a digest")
            return
        decided: list[Decisions] = []
        errors: list[str | None] = []
        new_intents: list[list[Intent]] = []
        for rep, result in zip(self.replicas, results):
            started: list[Intent] = []  # started by the harness below, once every replica's slots are checked
            applied = rep.runtime.apply_round(pending.number, pending.requests, result, started.extend)
            refused = applied.refused
            errors.append(None if refused is None else f"{type(refused).__name__}: {refused}")
            new_intents.append(started + applied.later)
            decided.append(applied.decided)
        if len(set(errors)) != 1:
            raise InvariantViolation(f"open raised differently across replicas: {errors}")
        report.refused = errors[0] is not None
        for rep, intents in zip(self.replicas, new_intents):
            self._check_slots(rep, intents)
        for rep, intents in zip(self.replicas, new_intents):
            rep.runtime.start(intents)
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
        resident = {page for page, _ in self.lead.ledger.index.items()}
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
                op = rep.state.ledger.open_ops.get(intent.serial)
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

    def step(self, requests: CacheRequests, reject_rank: int | None = None) -> StepReport:
        """One scheduler step on every replica."""
        self.number += 1
        number = self.number
        self.history.append((number, requests, reject_rank))
        for rep in self.replicas:
            rep.io.tick()
        report = StepReport(number)
        if self.lag and len(self.pipeline) >= self.lag:
            self._apply(self.pipeline.pop(0), report)
        inputs, taken = self._pack(number, requests, reject_rank)
        self.pipeline.append(Pending(number, requests, taken, inputs, self._reduce(inputs)))
        if not self.lag:
            self._apply(self.pipeline.pop(0), report)
        self.check_shared()
        return report

    def check_shared(self) -> None:
        digests = {rep.state.ledger.digest for rep in self.replicas}
        if len(digests) != 1:
            raise InvariantViolation(f"digests differ after step {self.number}: {digests}")
        for rep in self.replicas:
            st = rep.state
            alloc = st.ledger.allocator
            index_slots = [e.slot for _, e in st.ledger.index.items()]
            if len(set(index_slots)) != len(index_slots):
                raise InvariantViolation(f"replica {rep.rank}: two resident pages share a slot")
            allocated, retiring, free_slots = alloc.allocated, alloc.retiring, alloc.free_slots
            if not set(index_slots) <= allocated:
                raise InvariantViolation(f"replica {rep.rank}: a resident page's slot is not allocated")
            free = set(free_slots)
            if free & (allocated | retiring) or len(free) != len(free_slots):
                raise InvariantViolation(f"replica {rep.rank}: allocator sets overlap")
            if len(free) + len(allocated) + len(retiring) != alloc.pages:
                raise InvariantViolation(f"replica {rep.rank}: allocator lost slots")
            ledger = st.ledger
            held = [p for hold in ledger.holds.values() for p in hold.pages]
            counted = sum(e.held for _, e in ledger.index.items())
            distinct = sum(1 for _, e in ledger.index.items() if e.held)
            if not (len(held) == counted and len(set(held)) == distinct == ledger.held_pages <= ledger.hold_cap):
                raise InvariantViolation(f"replica {rep.rank}: holds of {len(held)} pages ({len(set(held))} distinct), "
                                         f"{counted} counted on pages ({distinct} held), {ledger.held_pages} in the "
                                         f"ledger, at most {ledger.hold_cap}")
            if any(p not in ledger.index for p in held):
                raise InvariantViolation(f"replica {rep.rank}: a held page is not resident")

    def open_prefetch_ids(self) -> list[int]:
        return sorted(op.request.op_id for op in self.lead.ledger.open_ops.values() if isinstance(op, Prefetch))

    def settle_all(self, max_steps: int = 200) -> int:
        """Complete every I/O and step (polling every open prefetch) until no
        operation is open. Returns the steps it took. Backups queued behind a
        window of one, each copy a few ticks and its round `lag` steps late,
        take tens of steps: the bound tells a wedged operation from those."""
        for rep in self.replicas:
            rep.io.end_all()
        for i in range(max_steps + 1):
            if not self.lead.ledger.open_ops and not any(p.requests.opened() for p in self.pipeline):
                return i
            if i == max_steps:
                break
            self.step(CacheRequests(prefetch_polls=tuple(self.open_prefetch_ids())) if i % 2 == 0 else CacheRequests())
        raise InvariantViolation(f"operations still open after {max_steps} idle steps with all I/O ended: "
                                 f"{[op.label() for op in self.lead.ledger.open_ops.values()]}")

    def check_quiescent(self) -> None:
        for rep in self.replicas:
            st = rep.state
            if st.ledger.open_ops or st.ledger.by_op_id:
                raise InvariantViolation(f"replica {rep.rank}: open operations remain: {list(st.ledger.open_ops)}")
            index_slots = {e.slot for _, e in st.ledger.index.items()}
            allocated, retiring = st.ledger.allocator.allocated, st.ledger.allocator.retiring
            if allocated != index_slots or retiring:
                raise InvariantViolation(f"replica {rep.rank}: allocated {sorted(allocated)} but resident "
                                         f"{sorted(index_slots)}, retiring {sorted(retiring)}")
