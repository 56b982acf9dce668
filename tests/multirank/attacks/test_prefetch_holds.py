"""Attack: a scheduler's prefetch holds on real daemons. Held pages are
counted alike on every rank, and every way a request lets go of them (its
loads sent, the request gone, a flush) releases them everywhere."""
import asyncio

import pytest

from cpcache.client import Client, SchedulerSession
from cpcache.daemon.launcher import LocalDomain

from .common import PAGE_HASHES, attach_all, close_all, make, spec, step_all, write_through

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(120)]


async def test_held_pages_are_agreed_and_every_release_path_frees_them(run_dir):
    settings = dict(storage="file", storage_root=str(run_dir / "pages"), prefetch_threshold_tokens=0,
                    prefetch_policy="wait_complete")
    async with LocalDomain(spec(run_dir, **settings)) as domain:
        s = make(domain, run_dir, 1)
        await attach_all(s)
        step, _ = await write_through(s, 1)
        while not (await step_all(s, step := step + 1))[0].backups:
            pass  # until the pages are in storage
        sessions = [SchedulerSession(Client(sock), first_step=step + 1) for sock in domain.sockets]

        def run(session: SchedulerSession) -> list[int]:
            held = []

            def prefetched(rid: str, pages: list[bytes]) -> None:
                session.prefetch(pages, len(pages) * 4, rid=rid, hold=True)
                while not session.prefetch_ended(rid):
                    session.flush()
                assert session.take_prefetched(rid) == len(pages)
                held.append(session.client.stats()["prefetch_held_pages"])

            def settled() -> None:
                session.flush()
                held.append(session.client.stats()["prefetch_held_pages"])

            prefetched("loaded", PAGE_HASHES[:2])
            session.release_hold("loaded")  # its loads were sent
            settled()
            prefetched("gone", PAGE_HASHES[:3])
            session.release("gone")  # aborted
            settled()
            prefetched("a", PAGE_HASHES[:2])
            prefetched("b", PAGE_HASHES[2:4])
            session.release_holds()  # a flush
            settled()
            return held

        results = await asyncio.gather(*(asyncio.to_thread(run, sess) for sess in sessions))
        assert results[0] == results[1] == [2, 0, 3, 0, 2, 4, 0]
        await close_all(s)
