"""Attack: the scheduler-side session with a request id used twice (a client-chosen rid, or a request
prefetched again after a retraction)."""
import asyncio

import pytest

from cpcache.client import Client, SchedulerSession
from cpcache.daemon.launcher import LocalDomain

from .common import PAGE_HASHES, PAGES, attach_all, close_all, make, spec, step_all, write_through

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(120)]


def storage_spec(run_dir):
    return spec(run_dir, storage="file", storage_root=str(run_dir / "pages"), prefetch_threshold_tokens=0,
                prefetch_policy="wait_complete")


async def test_a_second_prefetch_under_the_same_rid_is_run_and_ended_not_answered_from_the_first(run_dir):
    async with LocalDomain(storage_spec(run_dir)) as domain:
        s = make(domain, run_dir, 1)
        await attach_all(s)
        step, _ = await write_through(s, 1)  # pages now in storage (write_through policy)
        while True:  # until the backup is decided
            step += 1
            replies = await step_all(s, step)
            if replies[0].backups:
                break
        sessions = [SchedulerSession(Client(sock), first_step=step + 1) for sock in domain.sockets]

        def run(session, program):
            out = []
            for rid, pages in program:
                session.prefetch(pages, len(pages) * 4, rid=rid)
                for _ in range(200):
                    if session.prefetch_ended(rid):
                        break
                    session.flush()
                out.append(session.prefetched_pages(rid))
            for _ in range(5):
                session.flush()
            return out, len(session.open_prefetches())

        # rid "x" prefetches 2 pages (already resident in host: hits), then again 6 other pages.
        other = [bytes([5]) * 31 + bytes([i]) for i in range(PAGES)]
        program = [("x", PAGE_HASHES[:2]), ("x", other)]
        results = await asyncio.gather(*(asyncio.to_thread(run, sess, program) for sess in sessions))
        stats = [await c.client.stats() for c in s]
        opened = [st.get("open_prefetches") for st in stats]
        assert results[0] == results[1]
        (first, second), open_here = results[0]
        assert open_here == 0 and opened == [0, 0], (results, opened)
        await close_all(s)
