"""Attach is decided once per attempt, with one outcome on every rank
(docs/design.md rule 11), on real daemons: a refused attempt's descriptor never
matches a later one, a peer arriving at any moment around a rank's deadline
ends the attempt alike everywhere, and attaching again everywhere converges."""

import asyncio
import signal
from datetime import timedelta

import pytest

from cpcache import errors
from cpcache.agreement.collective import Rendezvous
from cpcache.daemon.launcher import LocalDomain
from cpcache.values import split_host_port

from .attacks.common import GEOMETRY, OTHER_GEOMETRY, TIMEOUT_S, attach_all, close_all, make, spec, step_all

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240)]


def outcome(result):
    return "attached" if not isinstance(result, BaseException) else type(result).__name__


async def attached_everywhere(schedulers):
    """Every daemon says attached, and the next step is decided alike."""
    assert [(await s.client.status()).attached for s in schedulers] == [True] * len(schedulers)
    step = max([(await s.client.stats()).get("last_step", 0) for s in schedulers]) + 1
    replies = await step_all(schedulers, step)
    assert len({r.wire for r in replies}) == 1


async def test_a_refused_attempts_descriptor_never_matches_a_later_attach(run_dir):
    async with LocalDomain(spec(run_dir)) as domain:
        # Rank 0 attaches geometry A, rank 1 geometry B: refused on both.
        first = make(domain, run_dir, 1, geometries={1: OTHER_GEOMETRY})
        results = await attach_all(first, return_exceptions=True)
        assert [outcome(r) for r in results] == ["FailedPrecondition"] * 2, results
        # Rank 0 alone attaches B: rank 1's B of the refused attempt must not match it.
        alone = make(domain, run_dir, 2, geometries={0: OTHER_GEOMETRY})[0]
        with pytest.raises(errors.Unavailable, match=r"ranks \[1\] did not attach"):
            await alone.client.attach("m", alone.geometry, 16, pool_fd=alone.pool.fd)
        assert [(await s.client.status()).attached for s in first] == [False, False]
        # Attaching again everywhere converges.
        again = make(domain, run_dir, 3)
        await attach_all(again)
        await attached_everywhere(again)
        await close_all([*first, alone, *again])


async def test_a_peer_attaching_before_or_after_a_ranks_deadline_ends_alike_everywhere(run_dir):
    """Rank 1 attaches once rank 0 has published (before its deadline), or
    once rank 0's deadline has decided the attempt "missing" (after it): each
    time both ranks end alike, and after a refusal attaching again everywhere
    converges. The moments are read from the store, not slept; every order of
    the two around the deadline is checked by the attach model."""
    async with LocalDomain(spec(run_dir)) as domain:
        config = domain.config(0)
        for life, moment in enumerate(("rank0", "decision", "rank0", "decision")):
            # Each life's scheduler attaching again forms the domain again:
            # its attach is the first attempt of epoch `life`.
            rdzv = Rendezvous(*split_host_port(config.rendezvous), config.deployment, life, 20.0)
            schedulers = make(domain, run_dir, life)
            early = asyncio.ensure_future(schedulers[0].client.attach(
                "m", GEOMETRY, 16, pool_fd=schedulers[0].pool.fd))
            await asyncio.to_thread(rdzv.connect().wait, [f"{rdzv.namespace}/domain0-1/attach/1/{moment}"],
                                    timedelta(seconds=30))
            late = schedulers[1].client.attach("m", GEOMETRY, 16, pool_fd=schedulers[1].pool.fd)
            results = await asyncio.gather(early, late, return_exceptions=True)
            outcomes = [outcome(r) for r in results]
            assert outcomes == (["attached"] * 2 if moment == "rank0" else ["Unavailable"] * 2), (moment, results)
            if moment == "decision":
                await attach_all(schedulers)  # docs/protocol.md's remedy: attach again on every rank
            await attached_everywhere(schedulers)
            await close_all(schedulers)


async def test_a_store_restarting_while_an_attach_is_decided_ends_it_alike_everywhere(run_dir):
    """Rank 0 has published its descriptor when the rendezvous store restarts
    and forgets it; rank 1 attaches into the empty store. Both end the same
    way (the decision is confirmed by a round of the domain, not trusted to
    the store), and attaching again everywhere converges."""
    async with LocalDomain(spec(run_dir)) as domain:
        schedulers = make(domain, run_dir, 1)
        config = domain.config(0)
        rdzv = Rendezvous(*split_host_port(config.rendezvous), config.deployment, 0, 20.0)
        published = f"{rdzv.namespace}/domain0-1/attach/1/rank0"
        early = asyncio.ensure_future(schedulers[0].client.attach("m", GEOMETRY, 16, pool_fd=schedulers[0].pool.fd))
        await asyncio.to_thread(rdzv.connect().wait, [published], timedelta(seconds=TIMEOUT_S))
        domain.restart_store()
        late = schedulers[1].client.attach("m", GEOMETRY, 16, pool_fd=schedulers[1].pool.fd)
        results = await asyncio.gather(early, late, return_exceptions=True)
        outcomes = [outcome(r) for r in results]
        assert len(set(outcomes)) == 1 and outcomes[0] in ("attached", "Unavailable"), results
        if outcomes[0] != "attached":
            await asyncio.gather(*(s.client.wait_serving(30) for s in schedulers))
            schedulers = make(domain, run_dir, 2)
            await attach_all(schedulers)  # docs/protocol.md's remedy
        await attached_everywhere(schedulers)
        await close_all(schedulers)


async def test_a_rank_that_never_confirms_leaves_its_peer_unattached_and_the_domain_forms_again(run_dir):
    """The confirmation round itself: rank 1 reads the decision but is stopped
    before it confirms, past the round's timeout. Rank 0 must not attach on a
    decision its peer never confirmed, and the domain forms again."""
    async with LocalDomain(spec(run_dir)) as domain:
        schedulers = make(domain, run_dir, 1)
        config = domain.config(0)
        rdzv = Rendezvous(*split_host_port(config.rendezvous), config.deployment, 0, 20.0)
        store = rdzv.connect()
        decided = f"{rdzv.namespace}/domain0-1/attach/1/decision"
        early = asyncio.ensure_future(schedulers[0].client.attach("m", GEOMETRY, 16, pool_fd=schedulers[0].pool.fd))
        await asyncio.to_thread(store.wait, [f"{rdzv.namespace}/domain0-1/attach/1/rank0"],
                                timedelta(seconds=TIMEOUT_S))
        # Rank 1's descriptor, published by hand: the decision is "attached",
        # and rank 1's daemon (stopped) never enters the confirmation.
        domain.signal(1, signal.SIGSTOP)
        try:
            descriptor = await asyncio.to_thread(store.get, f"{rdzv.namespace}/domain0-1/attach/1/rank0")
            store.compare_set(f"{rdzv.namespace}/domain0-1/attach/1/rank1", "", descriptor)
            await asyncio.to_thread(store.wait, [decided], timedelta(seconds=TIMEOUT_S))
            with pytest.raises(errors.Unavailable, match="not confirmed by every rank"):
                await early
            assert not (await schedulers[0].client.status()).attached
        finally:
            domain.signal(1, signal.SIGCONT)
        await asyncio.gather(*(s.client.wait_serving(30) for s in schedulers))
        statuses = [await s.client.status() for s in schedulers]
        assert statuses[0].epoch == statuses[1].epoch >= 1 and not any(st.attached for st in statuses)
        schedulers = make(domain, run_dir, 2)
        await attach_all(schedulers)
        await attached_everywhere(schedulers)
        await close_all(schedulers)
