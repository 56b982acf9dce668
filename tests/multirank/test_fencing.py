"""Epochs and sessions fence the data plane (docs/design.md rule 10), on real
daemons: a round a peer completes while this rank leaves its epoch is
applied here too, before the epoch's I/O drains, and answered alike on both
ranks; a host -> device load still queued when its session ends runs to its
end in its own session's pool (a forward may be reading it), never in the
next session's, which attaches only once it has ended."""

import asyncio

import numpy as np
import pytest

from cpcache.client import CacheRequests, LoadRequest, WriteRequest
from cpcache.daemon.launcher import LocalDomain

from .attacks.common import PAGE_HASHES, PAGES, attach_all, close_all, make, spec, step_all, write_through

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(180)]


async def until(predicate, what, timeout_s=30.0):
    """Ask the daemons again until `predicate()` (a coroutine) holds: each
    ask is an RPC that answers, no sleeping in between."""
    async def loop():
        while not await predicate():
            await asyncio.sleep(0)
    try:
        await asyncio.wait_for(loop(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"not within {timeout_s}s: {what}") from None


async def test_a_round_a_peer_completes_while_this_rank_leaves_its_epoch_is_answered_alike(run_dir):
    # A collective that waits up to 10 s: rank 0's old engine is still in it
    # when rank 1's late step arrives and completes it.
    async with LocalDomain(spec(run_dir, agreement_timeout_s=10.0)) as domain:
        old = make(domain, run_dir, 1)
        await attach_all(old)
        step, _ = await write_through(old, 1)
        late = CacheRequests(writes=(WriteRequest(2, [bytes([9]) * 32], [7]),))
        waiting = asyncio.ensure_future(old[0].client.step(step + 1, [], requests=late))

        async def rank0_took_it():
            return (await old[0].client.stats())["last_step"] == step + 1
        await until(rank0_took_it, "rank 0 took the step")
        new = make(domain, run_dir, 2)
        attaching = asyncio.ensure_future(new[0].client.attach("m", new[0].geometry, 16, pool_fd=new[0].pool.fd))

        async def rank0_left():
            return (await new[0].client.status()).state == "reforming"
        await until(rank0_left, "rank 0 leaves epoch 0")
        # Rank 1's old scheduler sends the same step late; rank 1 has not yet
        # seen the epoch move (rank 0 moves it only once it has left).
        peer = await old[1].client.step(step + 1, [], requests=late)
        assert peer.epoch == 0
        mine = await waiting
        assert mine.wire == peer.wire  # one decision, applied on both ranks before their I/O drained
        replies = await asyncio.gather(
            attaching, new[1].client.attach("m", new[1].geometry, 16, pool_fd=new[1].pool.fd))
        assert [r.resumed_pages for r in replies] == [PAGES, PAGES]
        # The new session decides alike on both ranks and its pages load back
        # intact: no copy of the old round ever touched their slots.
        step, expected = await write_through(new, 1)
        await load_back_intact(new, step + 1, expected)
        stats = [await s.client.stats() for s in new]
        assert [st["in_flight_slots"] for st in stats] == [0, 0]
        await close_all(old + new)


async def load_back_intact(schedulers, step, expected):
    load = LoadRequest(50, PAGE_HASHES, list(range(8, 8 + PAGES)))
    replies = await step_all(schedulers, step, CacheRequests(loads=(load,)))
    while 50 not in replies[0].loads:
        step += 1
        replies = await step_all(schedulers, step)
    await asyncio.gather(*(s.client.wait_loads([50]) for s in schedulers))
    for rank, s in enumerate(schedulers):
        for page in range(PAGES):
            assert np.array_equal(s.read(8 + page), expected[rank][page]), (rank, page)


async def test_a_load_queued_when_its_session_ends_lands_in_its_own_pool_never_in_the_next(run_dir):
    # Rank 0 copies on one thread, each copy up to 0.6 s late: its loads queue.
    slow = {0: dict(fault_copy_delay_ms=600.0, io_threads=1)}
    async with LocalDomain(spec(run_dir, per_rank=slow, storage_timeout_s=0.5)) as domain:
        old = make(domain, run_dir, 1)
        await attach_all(old)
        step, expected = await write_through(old, 1)
        loads = tuple(LoadRequest(10 + i, [PAGE_HASHES[i]], [PAGES + i]) for i in range(PAGES))
        # The step's round opens the loads and issues their copies (a load
        # closes only once every rank's copy has ended: later).
        await step_all(old, step + 1, CacheRequests(loads=loads))
        # The schedulers restart with new pools while rank 0's loads still queue.
        new = make(domain, run_dir, 2)
        before = [s.read(page).copy() for s in new for page in range(16)]
        await attach_all(new)
        # Attach returned: no job of the old session touches any pool any
        # more, and none was refused: every load landed in the old pool.
        stats = [await s.client.stats() for s in new]
        assert stats[0]["in_flight_slots"] == 0 and stats[0]["refused_late_jobs"] == 0, stats[0]
        for rank, s in enumerate(old):
            for i in range(PAGES):
                assert np.array_equal(s.read(PAGES + i), expected[rank][i]), (rank, i)
        after = [s.read(page) for s in new for page in range(16)]
        assert all(np.array_equal(b, a) for b, a in zip(before, after))
        # The new session loads its own pages into its own pool.
        await load_back_intact(new, 1, expected)
        await close_all(old + new)
