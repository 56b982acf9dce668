"""The stepper on one rank, in process: what a step opened still starts its
I/O when applying the round's answers fails, and a step that opens its
operations one by one keeps the whole step's pages, as it would whole."""

from __future__ import annotations

import asyncio

from cpcache.agreement.rounds import Questions
from cpcache.config import CacheConfig
from cpcache.errors import CacheError
from cpcache.keys import ShardingSpec
from cpcache.rank.assembly import CacheRuntime
from cpcache.rank.stepper import Stepper
from cpcache.requests import CacheRequests, LoadRequest, WriteRequest
from cpcache.state.allocator import PageAllocator
from cpcache.state.intents import CopyToHost
from cpcache.state.machine import CacheState
from tests.support.fakes import FakeIO, IOPlan, OneRankEngine


class RecordingIO(FakeIO):
    def __init__(self) -> None:
        super().__init__(IOPlan(max_delay=0))
        self.started: list = []

    def start(self, intents: list) -> None:
        self.started += intents
        super().start(intents)


def page(i: int) -> bytes:
    return bytes([i]) * 32


async def _a_write_whose_round_fails_to_apply(lag: int) -> tuple[RecordingIO, list, CacheState]:
    stepper = Stepper(OneRankEngine(), agreement_lag=lag)  # type: ignore[arg-type]
    state = CacheState(CacheConfig(), PageAllocator(8), ShardingSpec(), 16, 64)
    io = RecordingIO()
    stepper.runtime = CacheRuntime(state, io)  # type: ignore[arg-type]
    apply = state.apply

    def failing_apply(result):
        if result.number == 1:
            raise RuntimeError("a bug in apply")
        return apply(result)

    state.apply = failing_apply  # type: ignore[method-assign]
    acks = []
    for step in range(1, 5 + lag):
        requests = CacheRequests(writes=(WriteRequest(5, (page(1),), (0,)),)) if step == 1 else CacheRequests()
        try:
            acks += (await stepper.step(step, Questions.empty(), requests)).decided.write_acks
        except CacheError:
            pass  # round 1's own answer: the internal error
        io.tick()
    return io, acks, state


def test_what_a_step_opened_starts_its_io_even_when_applying_the_round_fails():
    for lag in (0, 1):
        io, acks, state = asyncio.run(_a_write_whose_round_fails_to_apply(lag))
        assert [i.serial for i in io.started if isinstance(i, CopyToHost)] == [1], lag
        assert acks == [5] and not state.ledger.open_ops, lag  # acknowledged, nothing left open


def test_opening_one_by_one_keeps_the_whole_steps_pages():
    """A stale load makes the step open its operations one by one; a later
    write must still not evict a page an earlier write of the step found."""
    outcomes = []
    for stale_load in (False, True):
        state = CacheState(CacheConfig(), PageAllocator(4), ShardingSpec(), 16, 64)
        state.ledger.index.insert([page(1)], state.ledger.allocator.allocate(1), None, 1)
        found = WriteRequest(10, (page(1), page(2)), (0, 1))  # page 1 is resident: kept
        room = WriteRequest(11, (page(3), page(4), page(5)), (2, 3, 4))  # needs 3 of the 3 free slots
        loads = (LoadRequest(12, (page(9),), (5,)),) if stale_load else ()
        requests = CacheRequests(writes=(found, room), loads=loads)
        try:
            _, decided = state.open(5, requests)
        except CacheError:
            _, decided = state.open_each(5, requests)
        outcomes.append((page(1) in state.ledger.index, decided.write_failures))
    assert outcomes[0] == outcomes[1] == (True, [11])
