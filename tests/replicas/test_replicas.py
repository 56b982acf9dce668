"""Property-based scheduler programs over N in-process replicas
(docs/design.md §11): invariants are checked after every step by the
harness."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpcache.config import CacheConfig
from cpcache.requests import CacheRequests, LoadRequest, PrefetchRequest, WriteRequest
from tests.replicas.conftest import LONG, REPLICA_SETTINGS
from tests.replicas.harness import Domain, InvariantViolation
from tests.support.fakes import FakeIO, IOPlan

UNIVERSE = [bytes([i]) * 32 for i in range(1, 17)]
DEVICE_PAGES = 64
PAGE_SIZE = 16
STEPS = 50
TIMEOUT = 3600 if LONG else 120

plans = st.builds(
    IOPlan,
    seed=st.integers(0, 2**32),
    max_delay=st.integers(0, 4),
    fail_rate=st.sampled_from([0.0, 0.0, 0.1, 0.3]),
    # Store timeouts in a third of the plans: pages whose backup timed out
    # turn suspect (test_eviction_of_suspect_pages_makes_room, below, is the
    # smallest program of what they once broke).
    timeout_rate=st.sampled_from([0.0, 0.0, 0.2]),
    storage_hit=st.sampled_from([1.0, 0.7, 0.3]),
)
configs = st.builds(
    CacheConfig,
    prefetch_policy=st.sampled_from(["best_effort", "wait_complete", "timeout"]),
    prefetch_threshold_tokens=st.sampled_from([0, 0, PAGE_SIZE * 2]),
    write_policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
    prefetch_timeout_base_s=st.just(3.0),
    backup_window=st.sampled_from([1, 64]),
    prefetch_hold_share=st.sampled_from([0.0, 0.5, 0.9]),
)


class Program:
    """Draws one step at a time from the replicas' shared state."""

    def __init__(self, data, domain: Domain) -> None:
        self.data = data
        self.domain = domain
        self.next_id = 1

    def draw(self, strategy):
        return self.data.draw(strategy)

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def pages(self) -> tuple[bytes, ...]:
        return tuple(self.draw(st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=4, unique=True)))

    def device(self, n: int) -> tuple[int, ...]:
        return tuple(self.draw(st.lists(st.integers(0, DEVICE_PAGES - 1), min_size=n, max_size=n)))

    def step_requests(self) -> CacheRequests:
        prefetches, polls, revokes, writes, loads, releases = [], [], [], [], [], []
        open_pf = self.domain.open_prefetch_ids()
        held = sorted(self.domain.lead.ledger.holds)
        resident = [p for p in UNIVERSE if self.domain.lead.match([p]) == 1]
        kinds = self.draw(st.lists(st.sampled_from(
            ["prefetch", "poll", "revoke", "write", "load", "release", "invalid"]), max_size=4))
        for kind in kinds:
            if kind == "prefetch":
                pages = self.pages()
                prefetches.append(PrefetchRequest(self.new_id(), pages, len(pages) * PAGE_SIZE, None,
                                                  self.draw(st.booleans())))
            elif kind == "release":  # a held prefetch's, or one holding nothing (ignored)
                op = self.draw(st.sampled_from(held)) if held and self.draw(st.booleans()) else self.new_id()
                if op not in releases:
                    releases.append(op)
            elif kind == "poll" and open_pf:
                op = self.draw(st.sampled_from(open_pf))
                if op not in polls and op not in revokes:
                    polls.append(op)
            elif kind == "revoke" and open_pf:
                op = self.draw(st.sampled_from(open_pf))
                if op not in polls and op not in revokes:
                    revokes.append(op)
            elif kind == "write":
                pages = self.pages()
                writes.append(WriteRequest(self.new_id(), pages, self.device(len(pages))))
            elif kind == "load" and resident:
                pages = tuple(self.draw(st.lists(st.sampled_from(resident), min_size=1, max_size=3, unique=True)))
                loads.append(LoadRequest(self.new_id(), pages, self.device(len(pages))))
            elif kind == "invalid":
                bad = self.draw(st.sampled_from(["dup", "device", "big_id", "poll_unknown", "not_resident",
                                                 "reopen", "empty"]))
                pages = self.pages()
                if bad == "dup":
                    i = self.new_id()
                    writes.append(WriteRequest(i, pages, self.device(len(pages))))
                    prefetches.append(PrefetchRequest(i, pages, 16))
                elif bad == "device":
                    writes.append(WriteRequest(self.new_id(), pages, (DEVICE_PAGES,) * len(pages)))
                elif bad == "big_id":
                    prefetches.append(PrefetchRequest(2**63 + self.draw(st.integers(0, 5)), pages, 16))
                elif bad == "poll_unknown":
                    polls.append(10**12 + self.new_id())
                elif bad == "not_resident":
                    missing = [p for p in UNIVERSE if p not in resident]
                    if missing:
                        loads.append(LoadRequest(self.new_id(), (missing[0],), (0,)))
                elif bad == "reopen" and self.domain.lead.ledger.by_op_id:
                    i = self.draw(st.sampled_from(sorted(self.domain.lead.ledger.by_op_id)))
                    prefetches.append(PrefetchRequest(i, pages, 16))
                elif bad == "empty":
                    writes.append(WriteRequest(self.new_id(), (), ()))
        return CacheRequests(tuple(prefetches), tuple(polls), tuple(revokes), tuple(writes), tuple(loads),
                             tuple(releases))


def run_program(data, replicas: int, lag: int, steps: int = STEPS) -> Domain:
    config = data.draw(configs)
    io_plans = data.draw(st.lists(plans, min_size=replicas, max_size=replicas))
    host_pages = data.draw(st.sampled_from([4, 8, 12]))
    domain = Domain(io_plans, config, host_pages=host_pages, page_size=PAGE_SIZE, device_pages=DEVICE_PAGES, lag=lag)
    program = Program(data, domain)
    for _ in range(steps):
        requests = program.step_requests()
        pick = data.draw(st.integers(0, 8 * replicas - 1))  # one step in 8: one replica rejects it
        reject = pick if pick < replicas else None
        domain.step(requests, reject)
    domain.settle_all()
    domain.check_quiescent()
    return domain


@pytest.mark.timeout(TIMEOUT)
@REPLICA_SETTINGS
@given(st.data(), st.integers(2, 4))
def test_lag0_replicas_agree(data, replicas):
    run_program(data, replicas, lag=0)


@pytest.mark.timeout(TIMEOUT)
@REPLICA_SETTINGS
@given(st.data(), st.integers(2, 3), st.integers(1, 3))
def test_lagged_replicas_agree(data, replicas, lag):
    run_program(data, replicas, lag=lag)


def test_harness_detects_an_early_ack():
    """The harness itself: a write acknowledged while a replica's copy still
    runs is caught."""
    domain = Domain([IOPlan(max_delay=0), IOPlan(max_delay=0)], CacheConfig())
    domain.step(CacheRequests(writes=(WriteRequest(1, (UNIVERSE[0],), (0,)),)))
    serial = domain.write_serials[1]
    domain.replicas[1].io.jobs[serial].ended = False
    from cpcache.state.intents import Decisions
    with pytest.raises(InvariantViolation):
        domain._check_acks(Decisions(write_acks=[1]))


def test_rejected_step_changes_nothing_and_settles():
    domain = Domain([IOPlan(seed=s, max_delay=3) for s in range(3)], CacheConfig(prefetch_threshold_tokens=0))
    requests = CacheRequests(prefetches=(PrefetchRequest(7, tuple(UNIVERSE[:3]), 48),),
                  writes=(WriteRequest(8, (UNIVERSE[5],), (1,)),))
    digest = domain.lead.ledger.digest
    report = domain.step(requests, reject_rank=2)
    assert report.rejected and domain.lead.ledger.digest == digest and not domain.lead.ledger.open_ops
    domain.step(requests)
    assert set(domain.lead.ledger.by_op_id) == {7, 8}
    domain.step(CacheRequests(prefetch_polls=(7,)))
    domain.settle_all()
    domain.check_quiescent()
    assert isinstance(domain.replicas[0].io, FakeIO)


def test_eviction_of_suspect_pages_makes_room():
    """Minimal program: 4 host slots; a write of 2 pages is acked; its backup
    times out on one replica (pages become io_suspect); a prefetch of 4 new
    pages hits storage on every replica. Evicting a suspect page would leave
    its slot retiring, not free, so the 2 suspect pages make no room: with 2
    free slots for 4 pages, deciding the hit evicts nothing (all or nothing)
    and revokes the prefetch, host pool full; the suspect pages stay in
    their slots and the domain settles."""
    from cpcache.state.intents import Decisions
    domain = Domain([IOPlan(max_delay=0, timeout_rate=1.0), IOPlan(max_delay=0)],
                    CacheConfig(prefetch_threshold_tokens=0), host_pages=4)
    written = list(UNIVERSE[:2])

    def pool() -> list[tuple[list[int], list[int], list[int], dict[bytes, tuple[int, bool]]]]:
        """Per replica: its free, allocated and retiring slots, and page -> (slot, io_suspect)."""
        seen = []
        for rep in domain.replicas:
            alloc, index = rep.state.ledger.allocator, rep.state.ledger.index
            seen.append((sorted(alloc.free_slots), sorted(alloc.allocated), sorted(alloc.retiring),
                         {p: (e.slot, e.io_suspect) for p, e in index.items()}))
        return seen

    assert domain.step(CacheRequests(writes=(WriteRequest(1, tuple(written), (0, 1)),))).decisions == Decisions()
    report = domain.step(CacheRequests())  # every copy ended: the ack, and write_through's backup starts
    assert report.decisions == Decisions(write_acks=[1], host_entered=written, host_entered_slots=[0, 1])
    report = domain.step(CacheRequests())  # replica 0's store timed out, replica 1's stored: MIN is TIMED_OUT
    assert report.decisions == Decisions(backups=[(2, False)])
    assert pool() == [([2, 3], [0, 1], [], {written[0]: (0, True), written[1]: (1, True)})] * 2
    assert domain.step(CacheRequests()).decisions == Decisions()

    report = domain.step(CacheRequests(prefetches=(PrefetchRequest(2, tuple(UNIVERSE[4:8]), 64),)))
    assert report.decisions == Decisions()
    report = domain.step(CacheRequests())  # the lookups answer: the hit is decided
    assert report.decisions == Decisions(prefetch_hits=[(2, 4)],
                                         prefetch_revoked=[(2, "host pool full: 4 pages do not fit")])
    assert pool() == [([2, 3], [0, 1], [], {written[0]: (0, True), written[1]: (1, True)})] * 2
    assert not domain.lead.ledger.open_ops
    assert domain.settle_all() == 0
    domain.check_quiescent()
