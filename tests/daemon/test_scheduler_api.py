"""The SGLang-shaped session over a real daemon: write-through, ack, load
back, prefetch from storage and release, one flush per iteration."""

import pytest

from cpcache.client import Client
from cpcache.client.session import HiCacheSession
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
        with Client(domain.sockets[0], timeout_s=10) as client:
            seed = client.attach("m", GEOMETRY, 16, pool_fd=pool.fd).key_seed
            cache = HiCacheSession(client)
            pages = [bytes.fromhex(h) for h in chain(list(range(64)), 16, seed)]
            write = cache.write_backup(pages[:2], [0, 1])
            acked = []
            for _ in range(100):  # iterations until the write-through is agreed done
                cache.flush()
                acked += cache.writing_check()
                if write in acked:
                    break
            assert acked == [write]
            assert cache.match_prefix(pages)[0] == 2
            load = cache.load_back(pages[:2], [4, 5])
            cache.flush()
            cache.wait_loads([load])
            loaded = []
            for _ in range(500):  # until the load and the backup of the first pages are agreed
                cache.flush()
                loaded += cache.loading_check()
                if load in loaded and cache.match_prefix(pages[:2])[1] == 2:
                    break
            assert loaded == [load]
            cache.flush()  # a step later, the pages are no longer "just used"
            # Fill the host pool (6 pages) with another chain, so that the first
            # pages are evicted; wait until both chains are in storage.
            other = [bytes.fromhex(h) for h in chain(list(range(1000, 1096)), 16, seed)]
            write2 = cache.write_backup(other, [6, 7, 8, 9, 10, 11])
            for _ in range(500):
                cache.flush()
                if cache.match_prefix(other)[1] == 6 and cache.match_prefix(pages[:2])[1] == 2:
                    break
            assert write2 in cache.writing_check()
            assert cache.match_prefix(pages[:2]) == (0, 2)
            cache.prefetch_from_storage("req-1", pages[:2], 32)
            for _ in range(200):
                cache.flush()
                if cache.check_prefetch_progress("req-1"):
                    break
            assert cache.prefetched_pages("req-1") == 2
            aborted = cache.prefetch_from_storage("req-2", pages[2:], 32)
            cache.flush()
            cache.release_aborted_request("req-2")  # sent, not ended: revoked in the next flush
            assert aborted in cache.flush().prefetch_revoked
            cache.prefetch_from_storage("req-3", pages[2:], 32)
            cache.release_aborted_request("req-3")  # never sent: dropped
            assert cache.flush().prefetch_revoked == {}
