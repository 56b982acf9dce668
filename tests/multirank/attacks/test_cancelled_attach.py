"""Attack: an Attach call cancelled by its client (deadline), then retried as docs/protocol.md tells
schedulers to retry a call whose outcome they did not see."""
import asyncio

import pytest

from cpcache.daemon.launcher import LocalDomain
from cpcache.values import Reduce

from .common import GEOMETRY, close_all, make, spec

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(120)]


async def test_a_retried_attach_after_a_cancelled_one_does_not_end_the_domains_session(run_dir):
    async with LocalDomain(spec(run_dir)) as domain:
        s = make(domain, run_dir, 1)
        first = asyncio.ensure_future(s[0].client.attach("m", GEOMETRY, 16, pool_fd=s[0].pool.fd))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(first), 0.3)
        first.cancel()  # the scheduler's deadline: the call is cancelled
        await s[1].client.attach("m", GEOMETRY, 16, pool_fd=s[1].pool.fd)  # rank 1 attaches, succeeds
        # Rank 0's scheduler did not see its outcome and attaches again (same pool, same everything):
        # the retry waits for the attach in progress and gets its answer.
        async def retry_attach():
            return await s[0].client.attach("m", GEOMETRY, 16, pool_fd=s[0].pool.fd)

        retry = asyncio.ensure_future(retry_attach())
        # Rank 1's scheduler, attached, takes its first step; rank 0 does once its retry returns.
        step1 = asyncio.ensure_future(s[1].client.step(1, [(1, Reduce.MIN, 1)]))
        outcome = await asyncio.gather(retry, return_exceptions=True)
        step0 = await asyncio.gather(s[0].client.step(1, [(1, Reduce.MIN, 1)]), return_exceptions=True)
        step1 = await asyncio.gather(step1, return_exceptions=True)
        statuses = [await c.client.status() for c in s]
        summary = (outcome, step0, step1, [(st.epoch, st.state, st.attached) for st in statuses])
        assert not any(isinstance(o, Exception) for o in (*outcome, *step0, *step1)), summary
        await close_all(s)
