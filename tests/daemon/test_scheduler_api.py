"""The scheduler-side session over a real daemon: write-through, ack, load
back, prefetch from storage and release, one flush per iteration."""

import threading

import pytest

from cpcache.client import Client, SchedulerSession
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.dataplane.pools import DevicePool
from cpcache.geometry import KVGeometry
from cpcache.keys import chain
from cpcache.topology import Topology

pytestmark = pytest.mark.timeout(60)

GEOMETRY = KVGeometry(layers=1, kv_kind="mla", heads=1, head_dim=32, dtype="float16", page_size=16)


async def test_a_scheduler_iteration_maps_to_one_flush(run_dir):
    spec = DomainSpec(Topology(tp=1), run_dir, extra=dict(storage="file", storage_root=str(run_dir / "pages"),
                                                          host_pool_pages=6, prefetch_threshold_tokens=0,
                                                          prefetch_policy="wait_complete"))
    async with LocalDomain(spec) as domain:
        pool = DevicePool.create_sealed(GEOMETRY, 16)
        with Client(domain.sockets[0], timeout_s=30) as client:
            seed = client.attach("m", GEOMETRY, 16, pool_fd=pool.fd).key_seed
            cache = SchedulerSession(client)

            def match_prefix(pages: list[bytes]) -> tuple[int, int]:  # the daemon's answer: host, storage pages
                reply = client.match(pages)
                return reply.host_pages, reply.storage_pages

            pages = [bytes.fromhex(h) for h in chain(list(range(64)), 16, seed)]
            acked: list[bool] = []
            cache.write_through(pages[:2], [0, 1], done=acked.append)
            for _ in range(100):  # iterations until the write-through is agreed done
                cache.flush()
                if acked:
                    break
            assert acked == [True]
            assert match_prefix(pages)[0] == 2 == cache.match(pages)
            loaded: list[bool] = []
            load = cache.load(pages[:2], [4, 5], done=loaded.append)
            cache.flush()
            client.wait_loads([load])
            for _ in range(500):  # until the load and the backup of the first pages are agreed
                cache.flush()
                if loaded and match_prefix(pages[:2])[1] == 2:
                    break
            assert loaded == [True]
            cache.flush()  # a step later, the pages are no longer "just used"
            # Fill the host pool (6 pages) with another chain, so that the first
            # pages are evicted; wait until both chains are in storage.
            other = [bytes.fromhex(h) for h in chain(list(range(1000, 1096)), 16, seed)]
            cache.write_through(other, [6, 7, 8, 9, 10, 11], done=acked.append)
            for _ in range(500):
                cache.flush()
                if match_prefix(other)[1] == 6 and match_prefix(pages[:2])[1] == 2:
                    break
            assert acked == [True, True]
            assert match_prefix(pages[:2]) == (0, 2)
            cache.prefetch(pages[:2], 32, rid="req-1")
            for _ in range(200):
                cache.flush()
                if cache.prefetch_ended("req-1"):
                    break
            assert cache.prefetched_pages("req-1") == 2
            aborted = cache.prefetch(pages[2:], 32, rid="req-2")
            cache.flush()
            cache.release("req-2")  # sent, not ended: revoked in the next flush
            assert aborted in cache.flush().prefetch_revoked
            cache.prefetch(pages[2:], 32, rid="req-3")
            cache.release("req-3")  # never sent: dropped
            assert cache.flush().prefetch_revoked == {}
            assert cache.tally.write_acks == 2 and cache.tally.load_acks == 1 and cache.tally.prefetch_done >= 1
            # Of the steps' time, the waits for their replies (each flush waits for its own).
            assert 0 < cache.tally.reply_wait_seconds < cache.tally.step_seconds


async def test_iterations_step_until_the_backups_of_acknowledged_pages_are_agreed(run_dir):
    """The daemon backs acknowledged pages up to storage on its own (write
    policy); only rounds agree those backups, and rounds come from steps. A
    scheduler whose write was acknowledged, and which calls nothing more,
    still steps until the backup is agreed, then stops."""
    spec = DomainSpec(Topology(tp=1), run_dir, extra=dict(storage="file", storage_root=str(run_dir / "pages"),
                                                          host_pool_pages=6))
    async with LocalDomain(spec) as domain:
        pool = DevicePool.create_sealed(GEOMETRY, 16)
        with Client(domain.sockets[0], timeout_s=30) as client:
            seed = client.attach("m", GEOMETRY, 16, pool_fd=pool.fd).key_seed
            cache = SchedulerSession(client)
            pages = [bytes.fromhex(h) for h in chain(list(range(48)), 16, seed)]
            acked: list[bool] = []
            cache.write_through(pages, [0, 1, 2], done=acked.append)
            iterations = 0
            while cache.iterate():  # each waits for the round of the step before
                iterations += 1
                assert iterations < 10_000, "still stepping"
            assert acked == [True]
            assert cache.tally.backups_stored == 1 and cache.tally.backups_failed == 0
            assert not cache.needs_step() and not cache.iterate()
            assert client.stats()["open_backups"] == 0


def _thread_names() -> set[str]:
    """The threads alive now, by name (each new one gets a new name: "Thread-N (...)")."""
    return {t.name for t in threading.enumerate()}


async def test_steps_one_at_a_time_keep_one_event_thread(run_dir):
    """A step sent at one iteration and taken at the next (`step_later`)
    reuses one event thread of the channel: gRPC would otherwise start one
    per step (its thread ends whenever no call is in flight), an OS thread
    a loaded host schedules late, on the scheduler's own thread."""
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir, extra=dict(host_pool_pages=4))) as domain:
        pool = DevicePool.create_sealed(GEOMETRY, 4)
        before = _thread_names()
        with Client(domain.sockets[0], timeout_s=30) as client:
            client.attach("m", GEOMETRY, 4, pool_fd=pool.fd)
            cache = SchedulerSession(client)
            seen: set[str] = set()
            for _ in range(30):  # as `iterate` does: sent at one iteration, taken at the next
                step, requests = cache.next_step()
                receive = client.step_later(step, requests=requests, epoch=cache.epoch)
                seen |= _thread_names() - before  # while the step is in flight
                cache.follow(receive())
            assert cache.tally.steps == 30
            assert len(seen) == 1, seen
            stats = client.stats()
        assert stats["rpc_calls_open"] == 2  # the Watch that keeps it, and this Stats
