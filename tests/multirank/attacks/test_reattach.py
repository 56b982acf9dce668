"""Attacks on re-attach (a new scheduler session) and the kept runtime."""

import pytest

from cpcache import errors
from cpcache.daemon.launcher import LocalDomain

from .common import OTHER_GEOMETRY, PAGE_HASHES, attach_all, close_all, make, spec, step_all, write_through

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(120)]


async def test_one_rank_reattaching_with_other_geometry_then_a_correct_retry_agrees(run_dir):
    """Schedulers restart; rank 1's new process is misconfigured (other page size).
    Attach fails on both (documented). The operator fixes rank 1 and attaches again
    on every rank: both ranks must start from the same shared state."""
    async with LocalDomain(spec(run_dir)) as domain:
        old = make(domain, run_dir, 1)
        await attach_all(old)
        await write_through(old, 1)
        bad = make(domain, run_dir, 2, geometries={1: OTHER_GEOMETRY})
        outcomes = await attach_all(bad, return_exceptions=True)
        assert all(isinstance(o, errors.FailedPrecondition) for o in outcomes), outcomes
        good = make(domain, run_dir, 3)
        replies = await attach_all(good)
        resumed = [r.resumed_pages for r in replies]
        steps = await step_all(good, 1, return_exceptions=True)
        matches = [(await s.client.match(PAGE_HASHES)).host_pages for s in good]
        # Both ranks must agree on what was carried over, answer Match alike and keep deciding together.
        assert (len(set(resumed)), len(set(matches))) == (1, 1), (resumed, matches, steps)
        assert not any(isinstance(o, Exception) for o in steps), steps
        await close_all(old + bad + good)
