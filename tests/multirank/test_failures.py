"""Divergence, a killed peer and a stopped peer: every surviving rank gets a
clear error in bounded time, naming who and what differs. Nothing hangs."""

import asyncio
import signal
import time

import pytest

from cpcache import errors
from cpcache.client import AsyncClient
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.daemon.server import ExitCode
from cpcache.topology import Topology
from cpcache.values import Reduce

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(120)]

TIMEOUT_S = 3.0


def spec(run_dir, **kw):
    return DomainSpec(Topology(tp=4, cp=2), run_dir, agreement_timeout_s=TIMEOUT_S, **kw)


async def step_all(clients, step, votes_by_rank):
    return await asyncio.gather(
        *(c.step(step, votes) for c, votes in zip(clients, votes_by_rank)), return_exceptions=True
    )


@pytest.mark.parametrize("lag", [0, 1])
async def test_divergent_operation_set_fails_that_step_everywhere_then_recovers(run_dir, lag):
    async with LocalDomain(spec(run_dir, agreement_lag=lag)) as domain:
        clients = [AsyncClient(s) for s in domain.sockets]
        same = [(1, Reduce.MIN, 5)]
        odd = [(1, Reduce.MIN, 5), (77, Reduce.MAX, 1)]
        await step_all(clients, 1, [same] * 4)
        results = await step_all(clients, 2, [same, same, odd, same])
        for _ in range(lag):  # a pipelined domain reports the round when it delivers it
            assert not any(isinstance(r, Exception) for r in results)
            results = await step_all(clients, 3, [same] * 4)
        for result in results:
            assert isinstance(result, errors.Divergence), result
            assert "operation 77 (vote, MAX) asked by ranks [2] but not by ranks [0, 1, 3]" in str(result)
        # The daemons keep serving: a consistent step goes through on every rank.
        after = await step_all(clients, 10, [same] * 4)
        after += await step_all(clients, 11, [same] * 4)
        assert not any(isinstance(r, Exception) for r in after), after
        assert len({r.wire for r in after[-4:]}) == 1
        for c in clients:
            await c.close()


@pytest.mark.parametrize("how", ["kill", "stop"])
async def test_lost_peer_fails_pending_and_later_calls_with_its_rank(run_dir, how):
    async with LocalDomain(spec(run_dir)) as domain:
        clients = [AsyncClient(s) for s in domain.sockets]
        assert not any(isinstance(r, Exception) for r in await step_all(clients, 1, [[]] * 4))
        survivors = [0, 1, 3]
        started = time.monotonic()
        pending = [asyncio.ensure_future(clients[r].step(2, [(5, Reduce.MIN, r)])) for r in survivors]
        # The pending rounds are in the survivors' hands before the peer goes.
        await asyncio.gather(*(wait_rounds_entered(clients[r]) for r in survivors))
        domain.signal(2, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        results = await asyncio.gather(*pending, return_exceptions=True)
        elapsed = time.monotonic() - started
        for result in results:
            assert isinstance(result, errors.Unavailable), result
            assert "ranks [2]" in str(result)
        assert elapsed < TIMEOUT_S + 1.0, f"took {elapsed:.2f}s"
        # Later calls fail at once, with the same diagnosis.
        started = time.monotonic()
        with pytest.raises(errors.Unavailable, match=r"ranks \[2\]"):
            await clients[0].step(3, [])
        assert time.monotonic() - started < 1.0
        assert (await clients[1].status()).state == "reforming"  # waiting for rank 2 in the next epoch
        for c in clients:
            await c.close()
        codes = await domain.stop()
        assert [codes[r] for r in survivors] == [ExitCode.PEER_LOST] * 3


async def wait_rounds_entered(client):
    """The step has reached the daemon once its Status shows it (Status is
    answered while the round waits)."""
    while (await client.status()).last_step < 2:
        await asyncio.sleep(0)  # yield to the pending call; no time-based wait
