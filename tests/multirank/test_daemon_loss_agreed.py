"""A daemon's death is never a disagreement (docs/design.md rule 12): whenever a
daemon dies (before its round, between its round and its reply, after its
reply) or a reply is late (the client's deadline passed), every rank's
scheduler is told the same thing for that step, and for the next.

The schedulers here use the blocking `Client` that SGLang's backend uses,
each knowing its peers' sockets; a daemon dies by fault injection at an exact
point (`fault_exit_after_round`) or by SIGKILL."""

import asyncio
import contextlib
import dataclasses
import signal
import threading

import pytest

from cpcache import errors
from cpcache.client import CacheRequests, Client, WriteRequest
from cpcache.daemon.launcher import LocalDomain
from cpcache.dataplane.pools import DevicePool
from cpcache.v1 import daemon_pb2 as pb
from cpcache.values import Reduce

from .attacks.common import GEOMETRY, PAGE_HASHES, PAGES, TIMEOUT_S, attach_all, close_all, make, spec

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(180)]

CLIENT_TIMEOUT_S = 10.0  # above the domain's 2 s agreement timeout plus the margin


def clients(domain, timeout_s=CLIENT_TIMEOUT_S):
    sockets = domain.sockets
    return [Client(s, timeout_s=timeout_s, peers=[p for p in sockets if p != s]) for s in sockets]


def write_step(step):
    return CacheRequests(writes=(WriteRequest(step, PAGE_HASHES[:2], [0, 1]),))


async def step_both(blocking, step, epoch, requests=None):
    """Step `step` on both ranks at once: each rank's reply, or its error."""
    return await asyncio.gather(
        *(asyncio.to_thread(c.step, step, [(1, Reduce.MIN, 1)], requests, epoch) for c in blocking),
        return_exceptions=True)


@contextlib.asynccontextmanager
async def attached_domain(run_dir, per_rank=None):
    """A 2-rank domain, attached: -> (domain, blocking clients that know their peers, the epoch)."""
    async with LocalDomain(spec(run_dir, per_rank=per_rank)) as domain:
        schedulers = make(domain, run_dir, 1)
        replies = await attach_all(schedulers)
        assert len({r.epoch for r in replies}) == 1
        blocking = clients(domain)
        try:
            yield domain, blocking, replies[0].epoch
        finally:
            for c in blocking:
                c.close()
            await close_all(schedulers)


def same_outcome(outcomes):
    """Both ranks were told the same: the same reply bytes, or errors."""
    if all(isinstance(o, errors.CacheError) for o in outcomes):
        return True
    return not any(isinstance(o, BaseException) for o in outcomes) and len({o.wire for o in outcomes}) == 1


async def test_a_daemon_dying_between_its_round_and_its_reply_leaves_its_rank_told_what_its_peer_was(run_dir):
    async with attached_domain(run_dir, {1: {"fault_exit_after_round": 3}}) as (domain, blocking, epoch):
        for step in (1, 2):
            assert same_outcome(await step_both(blocking, step, epoch))
        # Step 3 carries a write-through; rank 1's daemon decides it with rank
        # 0's, then dies before answering.
        outcomes = await step_both(blocking, 3, epoch, write_step(3))
        assert not isinstance(outcomes[0], BaseException), outcomes[0]
        assert same_outcome(outcomes), outcomes
        assert await domain.wait_exit(1, 30) != 0
        # The next step fails on both ranks: rank 0's round has no peer, and
        # rank 1 learns that from rank 0's daemon.
        outcomes = await step_both(blocking, 4, epoch)
        assert all(isinstance(o, errors.Unavailable) for o in outcomes), outcomes


async def test_a_daemon_killed_before_its_round_fails_the_step_on_every_rank(run_dir):
    async with attached_domain(run_dir) as (domain, blocking, epoch):
        assert same_outcome(await step_both(blocking, 1, epoch))
        domain.signal(1, signal.SIGKILL)
        await domain.wait_exit(1, 30)
        outcomes = await step_both(blocking, 2, epoch, write_step(2))
        assert all(isinstance(o, errors.Unavailable) for o in outcomes), outcomes


async def test_a_restarted_daemon_never_takes_a_step_of_the_session_before_it(run_dir):
    async with attached_domain(run_dir) as (domain, blocking, epoch):
        assert same_outcome(await step_both(blocking, 1, epoch))
        domain.signal(1, signal.SIGKILL)
        await domain.wait_exit(1, 30)
        await domain.restart(1)
        # Rank 1's client reaches the new instance: the old epoch's step is
        # refused there, and its outcome is rank 0's (which failed: no peer).
        outcomes = await step_both(blocking, 2, epoch)
        assert all(isinstance(o, errors.Unavailable) for o in outcomes), outcomes


async def test_a_step_whose_deadline_passes_before_its_round_ends_is_retried_not_given_up(run_dir):
    async with attached_domain(run_dir) as (domain, _, epoch):
        # Rank 0's deadline is far shorter than the round, which waits for rank 1.
        hasty = Client(domain.sockets[0], timeout_s=0.5, peers=[domain.sockets[1]], rank=0)
        patient = Client(domain.sockets[1], timeout_s=CLIENT_TIMEOUT_S, peers=[domain.sockets[0]])
        # Rank 1 steps only once rank 0's deadline has passed (its client recovers the step).
        late = threading.Event()
        recover = hasty._recover

        def recovering(request, failure):
            late.set()
            return recover(request, failure)

        hasty._recover = recovering
        first = asyncio.ensure_future(asyncio.to_thread(hasty.step, 1, [(1, Reduce.MIN, 1)], write_step(1), epoch))
        assert await asyncio.to_thread(late.wait, 30)
        second = await asyncio.to_thread(patient.step, 1, [(1, Reduce.MIN, 1)], write_step(1), epoch)
        assert (await first).wire == second.wire
        hasty.close()
        patient.close()


async def wait_taken(client, step):
    """Until the daemon behind `client` has taken step `step` (its status says so)."""
    while (await asyncio.to_thread(client.status)).last_step < step:
        await asyncio.sleep(0)  # yield only: each status call is the wait


async def test_a_step_fenced_for_a_gone_daemon_fails_on_every_rank_and_no_round_of_it_completes(run_dir):
    """Rank 0's daemon took step 2 and waits in its round; rank 0's scheduler
    counts that daemon gone (a stop that cancels its call, say) and asks rank
    1 how step 2 ended before rank 1 took it. Rank 1's "not taken" must be
    final: the step fails there too, and rank 0's round never completes with
    rank 1's late step (which would apply what rank 0's scheduler failed)."""
    async with attached_domain(run_dir) as (domain, blocking, epoch):
        assert same_outcome(await step_both(blocking, 1, epoch))
        taken = asyncio.ensure_future(asyncio.to_thread(blocking[0].step, 2, [(1, Reduce.MIN, 1)], write_step(2),
                                                        epoch))
        await wait_taken(blocking[0], 2)
        asker = blocking[0]._peers()[0]  # rank 0's scheduler asking rank 1's daemon, as its recovery does
        told = await asyncio.to_thread(asker._ask_outcome, pb.OutcomeRequest(epoch=epoch, step=2, fence=True,
                                                                             asking_rank=0), CLIENT_TIMEOUT_S)
        assert told.HasField("error") and told.error.reason == "PEER_LOST", told
        assert "daemon of rank 0 is gone" in told.error.message
        late = await asyncio.gather(asyncio.to_thread(blocking[1].step, 2, [(1, Reduce.MIN, 1)], write_step(2), epoch),
                                    return_exceptions=True)
        assert isinstance(late[0], errors.PeerLost) and late[0].missing_ranks == (0,), late
        assert isinstance((await asyncio.gather(taken, return_exceptions=True))[0], errors.Unavailable)


async def test_a_peer_stopped_past_the_deadline_is_asked_again_until_it_tells(run_dir):
    """Rank 0's daemon dies between its round and its reply; rank 1's daemon
    answers rank 1 and is then stopped (SIGSTOP) for longer than rank 0's
    client deadline. Rank 0 asks rank 1's daemon again until it answers, and
    is told what rank 1 applied."""
    async with attached_domain(run_dir, {0: {"fault_exit_after_round": 2}}) as (domain, blocking, epoch):
        assert same_outcome(await step_both(blocking, 1, epoch))
        hasty = Client(domain.sockets[0], timeout_s=3.0, peers=[domain.sockets[1]], rank=0)
        stopped, asked_in_vain = threading.Event(), threading.Event()
        recover = hasty._recover

        def after_the_stop(request, failure):
            stopped.wait(60)
            return recover(request, failure)

        hasty._recover = after_the_stop
        peer = hasty._peers()[0]
        ask = peer._ask_outcome

        def asking(request, timeout_s):
            try:
                return ask(request, timeout_s)
            except Exception:
                asked_in_vain.set()
                raise

        peer._ask_outcome = asking
        try:
            first = asyncio.ensure_future(asyncio.to_thread(hasty.step, 2, [(1, Reduce.MIN, 1)], write_step(2), epoch))
            applied = await asyncio.to_thread(blocking[1].step, 2, [(1, Reduce.MIN, 1)], write_step(2), epoch)
            domain.signal(1, signal.SIGSTOP)
            try:
                stopped.set()
                assert await asyncio.to_thread(asked_in_vain.wait, 60)
            finally:
                domain.signal(1, signal.SIGCONT)
            assert (await first).wire == applied.wire
        finally:
            hasty.close()


async def _told_from_the_ring(run_dir, votes, requests):
    """Rank 0's daemon dies between step 2's round and its reply, and rank
    1's daemon, which answered rank 1, is killed before rank 0 can ask it:
    no daemon can tell any more. -> (rank 0's step 2, rank 1's), rank 0's
    read from the outcome its own daemon recorded before answering."""
    async with attached_domain(run_dir, {0: {"fault_exit_after_round": 2}}) as (domain, blocking, epoch):
        assert same_outcome(await step_both(blocking, 1, epoch))
        assert blocking[0].hold_daemon()
        killed = threading.Event()
        recover = blocking[0]._recover

        def after_the_kill(request, failure):
            killed.wait(60)
            return recover(request, failure)

        blocking[0]._recover = after_the_kill
        first = asyncio.ensure_future(asyncio.to_thread(blocking[0].step, 2, votes, requests, epoch))
        applied = await asyncio.to_thread(blocking[1].step, 2, votes, requests, epoch)
        domain.signal(1, signal.SIGKILL)
        await domain.wait_exit(1, 30)
        killed.set()
        told = await first
        assert await domain.wait_exit(0, 30) != 0
        return told, applied


async def test_both_daemons_dying_around_one_step_leave_it_told_from_the_ring(run_dir):
    """Rank 0 applies what rank 1 applied, read from its own daemon's
    step-outcome ring."""
    told, applied = await _told_from_the_ring(run_dir, [(1, Reduce.MIN, 1)], write_step(2))
    assert told.wire == applied.wire


async def test_a_step_with_an_outcome_of_hundreds_of_kib_is_told_from_the_ring_too(run_dir):
    """As above, with a step whose answer is some hundred KiB (thousands of
    questions answered; a step acking a large write lists every page as
    much): the ring records outcomes of any size a step answers."""
    told, applied = await _told_from_the_ring(run_dir, [(q, Reduce.MIN, q) for q in range(1, 20_001)], None)
    assert len(applied.wire) > 64 * 1024 and told.wire == applied.wire


async def test_an_attach_whose_answer_comes_after_the_deadline_is_retried_not_failed(run_dir):
    """Rank 0's daemon freezes once the domain agreed the Attach, for longer
    than rank 0's client deadline: the client sends the Attach again and is
    told the attach that every rank made, instead of counting it failed
    beside a peer told it succeeded."""
    deadline_s = TIMEOUT_S + 5.5  # the least a client may wait on these daemons (DEADLINE_MARGIN_S)
    stall = {0: {"fault_stall_after_attach_ms": 1000 * (deadline_s + 2)}}
    async with LocalDomain(spec(run_dir, per_rank=stall)) as domain:
        pools = [DevicePool.create_sealed(GEOMETRY, 16) for _ in range(2)]
        attaching = [Client(s, timeout_s=deadline_s, peers=[p for p in domain.sockets if p != s], rank=r)
                     for r, s in enumerate(domain.sockets)]
        try:
            replies = await asyncio.gather(*(asyncio.to_thread(c.attach, "m", GEOMETRY, 16, pool_fd=pool.fd)
                                             for c, pool in zip(attaching, pools)), return_exceptions=True)
            assert not any(isinstance(r, BaseException) for r in replies), replies
            assert replies[0].epoch == replies[1].epoch
            assert "stalling" in domain.log_tail(0, 200)
            assert same_outcome(await step_both(attaching, replies[0].last_step + 1, replies[0].epoch))
        finally:
            for c in attaching:
                c.close()


async def test_an_attach_retried_after_its_epoch_ended_is_told_its_first_answer_and_both_ranks_fail_alike(run_dir):
    """As above, but rank 1, told "attached", steps at once (as SGLang does):
    its round fails (rank 0's daemon is frozen) and the domain moves to the
    next epoch before rank 0's retry arrives. The retry (the same attempt)
    is told the attach that every rank made, not a new one that no peer
    joins; that session's first step then fails on both ranks alike."""
    deadline_s = TIMEOUT_S + 5.5
    stall = {0: {"fault_stall_after_attach_ms": 1000 * (deadline_s + 2)}}
    async with LocalDomain(spec(run_dir, per_rank=stall)) as domain:
        pools = [DevicePool.create_sealed(GEOMETRY, 16) for _ in range(2)]
        attaching = [Client(s, timeout_s=deadline_s, peers=[p for p in domain.sockets if p != s], rank=r)
                     for r, s in enumerate(domain.sockets)]
        try:
            first = asyncio.ensure_future(asyncio.to_thread(attaching[0].attach, "m", GEOMETRY, 16,
                                                            pool_fd=pools[0].fd))
            told = await asyncio.to_thread(attaching[1].attach, "m", GEOMETRY, 16, pool_fd=pools[1].fd)
            stepped = await asyncio.gather(asyncio.to_thread(attaching[1].step, told.last_step + 1,
                                                             [(1, Reduce.MIN, 1)], None, told.epoch),
                                           return_exceptions=True)
            assert isinstance(stepped[0], errors.Unavailable), stepped
            retried = (await asyncio.gather(first, return_exceptions=True))[0]
            assert not isinstance(retried, BaseException), retried
            assert (retried.epoch, retried.last_step) == (told.epoch, told.last_step)
            late = await asyncio.gather(asyncio.to_thread(attaching[0].step, told.last_step + 1,
                                                          [(1, Reduce.MIN, 1)], None, told.epoch),
                                        return_exceptions=True)
            assert isinstance(late[0], errors.Unavailable), late
        finally:
            for c in attaching:
                c.close()


async def test_at_lag_1_a_gone_daemon_s_rank_waits_for_the_peer_to_take_the_step(run_dir):
    """At agreement lag 1 a step answers the round before it, which may have
    completed on every rank without the step itself: a peer that has not
    taken the step cannot tell yet, and says so (not "never"). Rank 1, whose
    daemon died after round 3, waits until rank 0 takes step 4, and both are
    told round 3's answer."""
    async with LocalDomain(spec(run_dir, lag=1)) as domain:
        schedulers = make(domain, run_dir, 1)
        epoch = (await attach_all(schedulers))[0].epoch
        sockets = domain.sockets
        ranks = [Client(sockets[r], timeout_s=CLIENT_TIMEOUT_S, peers=[p for p in sockets if p != sockets[r]], rank=r)
                 for r in range(2)]
        try:
            for step in (1, 2, 3):
                assert same_outcome(await step_both(ranks, step, epoch))
            for c in ranks:  # round 3 completed on both (step 3 answered round 2)
                while (await asyncio.to_thread(c.status)).rounds_completed < 3:
                    await asyncio.sleep(0)
            domain.signal(1, signal.SIGKILL)
            await domain.wait_exit(1, 30)
            asked = threading.Event()
            peer = ranks[1]._peers()[0]
            ask = peer._ask_outcome

            def asking(request, timeout_s):
                try:
                    return ask(request, timeout_s)
                finally:
                    asked.set()

            peer._ask_outcome = asking
            gone = asyncio.ensure_future(asyncio.to_thread(ranks[1].step, 4, [(1, Reduce.MIN, 1)], None, epoch))
            assert await asyncio.to_thread(asked.wait, 60)
            taken = await asyncio.gather(asyncio.to_thread(ranks[0].step, 4, [(1, Reduce.MIN, 1)], None, epoch),
                                         return_exceptions=True)
            outcomes = taken + await asyncio.gather(gone, return_exceptions=True)
            assert same_outcome(outcomes), outcomes
        finally:
            for c in ranks:
                c.close()
            await close_all(schedulers)


async def _first_of(future, log, line):
    """Until `future` is done or `log` holds `line`: waiting on the future,
    reading the log between waits."""
    while not future.done() and line not in log.read_text(errors="replace"):
        await asyncio.wait({future}, timeout=0.05)


async def test_a_daemon_stopped_while_its_step_waits_for_a_late_peer_answers_it_as_the_peer_does(run_dir):
    """SIGTERM reaches rank 0's daemon while its step's round waits for rank
    1, whose step comes late; rank 0's client, whose deadline is short,
    keeps sending the step again. The daemon answers that step before its
    server stops, so both ranks are told the same. (It used to stop its
    server once no call was in flight, between two tries: rank 0's client,
    finding it gone, took rank 1's "not taken" as final, and rank 1 then
    completed the round with rank 0's engine and applied it.)"""
    late_spec = dataclasses.replace(spec(run_dir), agreement_timeout_s=6.0)  # rank 1 comes well within it
    async with LocalDomain(late_spec) as domain:
        schedulers = make(domain, run_dir, 1)
        epoch = (await attach_all(schedulers))[0].epoch
        # Three tries of 1 s each: more than it takes rank 1 to come once asked.
        hasty = Client(domain.sockets[0], timeout_s=1.0, peers=[domain.sockets[1]])
        patient = Client(domain.sockets[1], timeout_s=20.0, peers=[domain.sockets[0]])
        try:
            tried = threading.Event()
            recover = hasty._recover

            def recovering(request, failure):
                tried.set()
                return recover(request, failure)

            hasty._recover = recovering
            first = asyncio.ensure_future(
                asyncio.to_thread(hasty.step, 1, [(1, Reduce.MIN, 1)], write_step(1), epoch))
            assert await asyncio.to_thread(tried.wait, 30)  # rank 0's round waits for rank 1
            domain.signal(0, signal.SIGTERM)
            # Rank 1 steps once rank 0's daemon says it answers the steps it
            # took before stopping (or, as it used to, once rank 0's client
            # has its outcome).
            await _first_of(first, domain.logs[0], "waiting for the steps taken")
            second = await asyncio.to_thread(patient.step, 1, [(1, Reduce.MIN, 1)], write_step(1), epoch)
            outcomes = await asyncio.gather(first, return_exceptions=True) + [second]
            assert same_outcome(outcomes), outcomes
            assert await domain.wait_exit(0, 30) in (0, 4)
        finally:
            hasty.close()
            patient.close()
            await close_all(schedulers)


def test_a_client_whose_deadline_the_agreement_timeout_does_not_fit_is_refused():
    client = Client("/nonexistent.sock", timeout_s=12.0)
    with pytest.raises(errors.InvalidArgument, match=r"timeout_s \(12\).*agreement_timeout_s \(10\)"):
        client.check_deadline(10.0)
    Client("/nonexistent.sock", timeout_s=16.0).check_deadline(10.0)


assert PAGES >= 2
