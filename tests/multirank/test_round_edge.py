"""The edge of a round's timeout with three ranks (docs/design.md rules 4 and
12): gloo ends a collective on each rank apart, so one rank can see its round
fail while its peers completed it and applied it. That rank asks its peers
before it fails the round and applies what they completed, so every rank's
scheduler is told the same for that step; the next step then fails on every
rank (the epoch ends). A round no live peer completed still fails on every
rank, and the survivors stop asking once each has told the others.

The schedulers are the blocking `Client` that SGLang's backend uses, each
knowing its peers' sockets. The edge is made exact by fault injection
(`fault_round_lost_after_complete`: the round completes on the rank, which
then reports it timed out)."""

import contextlib
import dataclasses
import signal

import pytest

from cpcache import errors
from cpcache.client import Client
from cpcache.daemon.launcher import LocalDomain
from cpcache.topology import Topology

from .attacks.common import attach_all, close_all, make, spec
from .test_daemon_loss_agreed import step_both, write_step

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(240)]

CLIENT_TIMEOUT_S = 15.0  # above the domain's 2 s agreement timeout plus the margin
RECOVERED = "failed here but rank"
NONE_COMPLETED = "no live peer completed it"
NOBODY_TOLD = "no peer told within"


@contextlib.asynccontextmanager
async def three_ranks(run_dir, per_rank=None):
    """A 3-rank domain, attached: -> (domain, blocking clients that know their peers, the epoch)."""
    async with LocalDomain(dataclasses.replace(spec(run_dir, per_rank=per_rank), topology=Topology(tp=3))) as domain:
        schedulers = make(domain, run_dir, 1)
        replies = await attach_all(schedulers)
        assert len({r.epoch for r in replies}) == 1
        sockets = domain.sockets
        blocking = [Client(s, timeout_s=CLIENT_TIMEOUT_S, peers=[p for p in sockets if p != s]) for s in sockets]
        try:
            yield domain, blocking, replies[0].epoch
        finally:
            for c in blocking:
                c.close()
            await close_all(schedulers)


def same_replies(outcomes):
    return not any(isinstance(o, BaseException) for o in outcomes) and len({o.wire for o in outcomes}) == 1


async def test_a_round_one_rank_lost_at_the_edge_is_applied_there_as_its_peers_did(run_dir):
    async with three_ranks(run_dir, {0: {"fault_round_lost_after_complete": 3}}) as (domain, blocking, epoch):
        for step in (1, 2):
            assert same_replies(await step_both(blocking, step, epoch))
        # Step 3 opens a write-through: ranks 1 and 2 complete its round and
        # apply it; rank 0 completes it too, and reports it timed out.
        outcomes = await step_both(blocking, 3, epoch, write_step(3))
        assert same_replies(outcomes), outcomes
        log = domain.logs[0].read_text(errors="replace")
        assert "fault injection: round 3 completed" in log
        assert f"round 3 {RECOVERED}" in log
        # The epoch ends: the next step fails on every rank.
        outcomes = await step_both(blocking, 4, epoch)
        assert all(isinstance(o, errors.Unavailable) for o in outcomes), outcomes
        for rank in (1, 2):
            log = domain.logs[rank].read_text(errors="replace")
            assert RECOVERED not in log and NOBODY_TOLD not in log


async def test_a_round_no_peer_completed_fails_on_every_rank_and_the_survivors_stop_asking(run_dir):
    async with three_ranks(run_dir) as (domain, blocking, epoch):
        assert same_replies(await step_both(blocking, 1, epoch))
        domain.signal(2, signal.SIGKILL)
        await domain.wait_exit(2, 30)
        outcomes = await step_both(blocking, 2, epoch, write_step(2))
        assert all(isinstance(o, errors.Unavailable) for o in outcomes), outcomes
        for rank in (0, 1):
            log = domain.logs[rank].read_text(errors="replace")
            # Each survivor asked, was told by the other that it had not
            # completed the round (the dead rank counted out), and stopped
            # asking before its wait ran out.
            assert f"round 2: {NONE_COMPLETED}" in log, domain.log_tail(rank, 40)
            assert NOBODY_TOLD not in log and RECOVERED not in log
            assert log.index("agreement broken") > log.index(f"round 2: {NONE_COMPLETED}")


async def test_a_round_whose_scheduler_is_late_on_one_rank_fails_without_waiting_out_the_ask(run_dir):
    async with three_ranks(run_dir) as (domain, blocking, epoch):
        assert same_replies(await step_both(blocking, 1, epoch))
        # Rank 2's scheduler does not send step 2 until the others have failed it.
        outcomes = await step_both(blocking[:2], 2, epoch)
        assert all(isinstance(o, errors.Unavailable) for o in outcomes), outcomes
        for rank in (0, 1):
            log = domain.logs[rank].read_text(errors="replace")
            # Rank 2 had not entered round 2 when asked: it cannot complete
            # it any more, so the survivors stop asking at once.
            assert f"round 2: {NONE_COMPLETED}" in log, domain.log_tail(rank, 40)
            assert NOBODY_TOLD not in log and RECOVERED not in log
        late = await step_both(blocking[2:], 2, epoch)
        assert isinstance(late[0], errors.Unavailable), late
