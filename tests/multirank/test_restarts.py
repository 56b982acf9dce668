"""Restarts without losing the cache. A scheduler that attaches again starts
a new session in which the host pool's pages are still found; a daemon that
dies and comes back (the launcher restarts it, as systemd would) finds its
domain formed again in the next epoch; a daemon stopped past the agreement
timeout learns on waking that its domain moved on, and never decides in its
old epoch."""

import asyncio
import signal
from datetime import timedelta

import numpy as np
import pytest

from cpcache import errors
from cpcache.agreement.collective import Rendezvous
from cpcache.agreement.epochs import Epochs
from cpcache.client import AsyncClient, CacheRequests, LoadRequest
from cpcache.daemon.launcher import LocalDomain
from cpcache.values import Reduce, split_host_port

from .attacks.common import GEOMETRY, PAGE_HASHES, PAGES, attach_all, make, spec, write_through
from .attacks.common import step_all as step_all_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(180)]


async def start_sessions(domain, run_dir, life):
    schedulers = make(domain, run_dir, life)
    return schedulers, await attach_all(schedulers)


async def step_all(schedulers, step, requests=None):
    """One step on every rank; the replies must be the same bytes."""
    replies = await step_all_ranks(schedulers, step, requests)
    assert len({r.wire for r in replies}) == 1
    return replies[0]


async def test_a_scheduler_that_attaches_again_finds_the_host_pages_of_its_last_session(run_dir):
    async with LocalDomain(spec(run_dir)) as domain:
        old, _ = await start_sessions(domain, run_dir, 1)
        step, expected = await write_through(old, 1)
        # The schedulers restart: new processes, new pools, and they attach again.
        new, replies = await start_sessions(domain, run_dir, 2)
        assert [r.resumed_pages for r in replies] == [PAGES, PAGES]
        statuses = [await s.client.status() for s in new]
        assert {st.epoch for st in statuses} == {1} and {st.state for st in statuses} == {"serving"}
        assert [(await s.client.match(PAGE_HASHES)).host_pages for s in new] == [PAGES, PAGES]
        # Steps go on from 1 in the new session; the pages load into the new pools intact.
        reply = await step_all(new, 1, CacheRequests(loads=(LoadRequest(9, PAGE_HASHES, list(range(8, 8 + PAGES))),)))
        assert reply.epoch == 1
        step = 1
        while 9 not in reply.loads:
            step += 1
            reply = await step_all(new, step)
        for rank, s in enumerate(new):
            for page in range(PAGES):
                assert np.array_equal(s.read(8 + page), expected[rank][page]), (rank, page)
        # Another model (or geometry) starts clean, and says so.
        other = [AsyncClient(s) for s in domain.sockets]
        replies = await asyncio.gather(*(c.attach("another-model", GEOMETRY, 16, pool_fd=s.pool.fd)
                                         for c, s in zip(other, new)))
        assert [r.resumed_pages for r in replies] == [0, 0]
        for c in [*other, *(s.client for s in old + new)]:
            await c.close()


async def test_a_killed_daemon_restarted_by_the_launcher_rejoins_its_domain_in_the_next_epoch(run_dir):
    async with LocalDomain(spec(run_dir)) as domain:
        schedulers, _ = await start_sessions(domain, run_dir, 1)
        step, _ = await write_through(schedulers, 1)
        domain.signal(1, signal.SIGKILL)
        with pytest.raises(errors.Unavailable, match=r"ranks \[1\]"):
            await schedulers[0].client.step(step + 1, [(1, Reduce.MIN, 1)])
        with pytest.raises(errors.Unavailable, match="re-forming its domain out of epoch 0"):
            await schedulers[0].client.step(step + 2, [(1, Reduce.MIN, 1)])
        await domain.restart(1)
        await schedulers[0].client.wait_serving(30)
        statuses = [await AsyncClient(s).status() for s in domain.sockets]
        assert [st.epoch for st in statuses] == [1, 1] and {st.state for st in statuses} == {"serving"}
        # The restarted rank's host pool is new: nothing is carried over; storage would be untouched.
        schedulers, replies = await start_sessions(domain, run_dir, 2)
        assert [r.resumed_pages for r in replies] == [0, 0]
        assert [(await s.client.match(PAGE_HASHES)).host_pages for s in schedulers] == [0, 0]
        reply = await step_all(schedulers, 1)
        assert reply.epoch == 1 and reply.decisions == {1: 1}


async def test_a_daemon_stopped_past_the_timeout_learns_its_domain_moved_on_and_rejoins(run_dir):
    async with LocalDomain(spec(run_dir)) as domain:
        clients = [AsyncClient(s) for s in domain.sockets]
        await asyncio.gather(*(c.step(1, [(1, Reduce.MIN, 1)]) for c in clients))
        domain.signal(1, signal.SIGSTOP)
        with pytest.raises(errors.Unavailable, match=r"ranks \[1\]"):
            await clients[0].step(2, [(1, Reduce.MIN, 1)])
        assert (await clients[0].status()).state == "reforming"
        domain.signal(1, signal.SIGCONT)
        await asyncio.gather(*(c.wait_serving(60) for c in clients))
        statuses = [await c.status() for c in clients]
        assert [st.epoch for st in statuses] == [1, 1]
        # Both decide together again, in the new epoch only.
        replies = await asyncio.gather(*(c.step(3, [(1, Reduce.MIN, 5)]) for c in clients))
        assert {r.epoch for r in replies} == {1} and {r.decisions[1] for r in replies} == {5}
        for c in clients:
            await c.close()


async def test_epochs_only_grow_across_restarts_of_the_rendezvous_store(run_dir):
    async with LocalDomain(spec(run_dir)) as domain:
        await start_sessions(domain, run_dir, 1)
        schedulers, _ = await start_sessions(domain, run_dir, 2)  # attached again: epoch 1
        assert (await step_all(schedulers, 1)).epoch == 1
        # The store restarts and forgets the counter; a scheduler attaching
        # again at once moves the domain past epoch 1, not back to 0.
        domain.restart_store()
        schedulers, _ = await start_sessions(domain, run_dir, 3)
        assert (await step_all(schedulers, 1)).epoch == 2
        # It restarts again; the serving ranks write their epoch back (and
        # its "formed" mark), so a daemon restarted now joins a later epoch.
        domain.restart_store()
        config = domain.config(0)
        rdzv = Rendezvous(*split_host_port(config.rendezvous), config.deployment, 0, 20.0)
        store = rdzv.connect()
        await asyncio.to_thread(store.wait, [Epochs(rdzv, (0, 1)).formed_key(2)], timedelta(seconds=30))
        domain.signal(1, signal.SIGKILL)
        await domain.restart(1)
        await asyncio.gather(*(s.client.wait_serving(30) for s in schedulers))
        statuses = [await s.client.status() for s in schedulers]
        assert [st.epoch for st in statuses] == [3, 3] and {st.state for st in statuses} == {"serving"}
        schedulers, _ = await start_sessions(domain, run_dir, 4)
        assert (await step_all(schedulers, 1)).epoch == 3  # its first session of epoch 3
