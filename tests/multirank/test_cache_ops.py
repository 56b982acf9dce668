"""The cache protocol through real daemons: a revoke while reads are still in
flight on one rank, and every error status, after which the daemon serves on
with its shared state untouched."""

import numpy as np
import pytest
import torch

from cpcache import errors
from cpcache.client import AsyncClient, CacheRequests, LoadRequest, PrefetchRequest, WriteRequest
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.dataplane.pools import DevicePool
from cpcache.dataplane.storage import PageBuffer, open_backend
from cpcache.geometry import KVGeometry
from cpcache.keys import ShardingSpec, chain, tenant_of
from cpcache.testing.sim.pages import page_content
from cpcache.topology import Topology

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(120)]

GEOMETRY = KVGeometry(layers=2, kv_kind="mha", heads=1, head_dim=16, dtype="bfloat16", page_size=16)
PAGES = 8


async def attach_all(domain, run_dir, device_pages=32):
    """Attach every rank at once (Attach is agreed across the domain)."""
    import asyncio

    clients = [AsyncClient(socket) for socket in domain.sockets]
    pools = [DevicePool.create_sealed(GEOMETRY, device_pages) for _ in clients]
    replies = await asyncio.gather(*(c.attach("test-model", GEOMETRY, device_pages, pool_fd=pool.fd)
                                     for c, pool in zip(clients, pools)))
    return clients, pools, replies[0].key_seed


def write_page(pool: DevicePool, device_page: int, content: np.ndarray) -> None:
    view = pool.page_view(device_page)
    view.copy_(torch.from_numpy(content.copy()).view(view.dtype).view(view.shape))


def read_page(pool: DevicePool, device_page: int) -> np.ndarray:
    return pool.page_view(device_page).contiguous().view(-1).view(torch.uint8).numpy()


async def step_all(clients, step, requests=None):
    replies = [await_ for await_ in [c.step(step, requests=requests) for c in clients]]
    import asyncio

    results = await asyncio.gather(*replies)
    assert len({r.wire for r in results}) == 1, f"step {step}: replies differ"
    return results[0]


async def test_revoked_prefetch_keeps_its_slots_until_the_slow_rank_is_done(run_dir):
    topology = Topology(tp=2)  # attention TP 2: keys end in tp0_2 / tp1_2
    spec = DomainSpec(topology, run_dir, extra=dict(storage="file", storage_root=str(run_dir / "pages"),
                                                    host_pool_pages=PAGES, prefetch_threshold_tokens=0),
                      per_rank={1: dict(fault_storage_delay_ms=600.0)})
    async with LocalDomain(spec) as domain:
        clients, pools, seed = await attach_all(domain, run_dir)
        pages = chain(list(range(PAGES * GEOMETRY.page_size)), GEOMETRY.page_size, seed)
        # The pages are in storage (written with the same backend, as a peer would).
        for rank in range(2):
            backend = open_backend("file", root=str(run_dir / "pages"), geometry_fingerprint=GEOMETRY.fingerprint())
            # The daemon keys every page by the attached model's tenant.
            sharding = ShardingSpec(tp_rank=rank, tp_size=2, tenant=tenant_of("test-model", GEOMETRY.fingerprint()))
            keys = [sharding.storage_key(p) for p in pages]
            data = np.concatenate([page_content(key, GEOMETRY.page_bytes) for key in keys])
            buffers = [PageBuffer(0, data[i * GEOMETRY.page_bytes:(i + 1) * GEOMETRY.page_bytes]) for i in range(PAGES)]
            assert backend.put_from(keys, buffers) == [True] * PAGES
        hashes = [bytes.fromhex(p) for p in pages]
        step = 1
        prefetch = PrefetchRequest(1, hashes, PAGES * GEOMETRY.page_size)
        await step_all(clients, step, CacheRequests(prefetches=(prefetch,)))
        hit = None
        while hit is None:  # each step is a round; the hit is agreed once both ranks have looked
            step += 1
            hit = (await step_all(clients, step)).prefetch_hits.get(1)
        assert hit == PAGES
        # Rank 1's reads into the 8 host slots are slow. Revoke now.
        step += 1
        reply = await step_all(clients, step, CacheRequests(revokes=(1,)))
        assert 1 in reply.prefetch_revoked
        stats = [await c.stats() for c in clients]
        assert stats[1]["in_flight_slots"] == PAGES
        assert {s["host_pages_retiring"] for s in stats} == {PAGES}  # shared state: the same on both
        # A write that needs those slots is refused while any rank still reads into them...
        contents = []
        for rank, pool in enumerate(pools):
            suffix = ShardingSpec(tp_rank=rank, tp_size=2).suffix()
            new = [page_content(f"new-{i}-{suffix}", GEOMETRY.page_bytes) for i in range(PAGES)]
            for i, c in enumerate(new):
                write_page(pool, i, c)
            contents.append(new)
        fresh = [bytes([9]) * 31 + bytes([i]) for i in range(PAGES)]
        write = CacheRequests(writes=(WriteRequest(2, fresh, list(range(PAGES))),))
        refused = 0
        while True:
            step += 1
            reply = await step_all(clients, step, write)
            if 2 not in reply.write_failures:
                break
            # No room while any rank still reads into those slots: the write
            # fails alike on every rank and the scheduler tries again later.
            refused += 1
            step += 1
            await step_all(clients, step)
        assert refused >= 1
        stats = [await c.stats() for c in clients]
        assert stats[1]["pages_moved_storage_to_host"] == PAGES  # the slow reads did end first
        acked = ()
        while 2 not in acked:
            step += 1
            acked = (await step_all(clients, step)).write_acks
        # The late reads did not overwrite the new pages: load them back and compare.
        step += 1
        await step_all(clients, step, CacheRequests(loads=(LoadRequest(3, fresh, list(range(16, 16 + PAGES))),)))
        for c in clients:
            await c.wait_loads([3], timeout_s=10)
        for rank, pool in enumerate(pools):
            for i in range(PAGES):
                assert np.array_equal(read_page(pool, 16 + i), contents[rank][i]), f"rank {rank} page {i}"
        for c in clients:
            await c.close()


@pytest.fixture
async def single(run_dir):
    # threshold 0: a prefetch with no storage hit stays open until polled or revoked
    spec = DomainSpec(Topology(tp=1), run_dir, extra=dict(storage="file", storage_root=str(run_dir / "pages"),
                                                          host_pool_pages=PAGES, prefetch_threshold_tokens=0))
    async with LocalDomain(spec) as domain:
        yield domain


async def test_every_error_status_leaves_the_daemon_serving_and_state_unchanged(single, run_dir):
    client = AsyncClient(single.sockets[0])
    with pytest.raises(errors.FailedPrecondition, match="no device pool is attached"):
        await client.step(1, requests=CacheRequests(revokes=(5,)))
    pool = DevicePool.create_sealed(GEOMETRY, 4)
    with pytest.raises(errors.InvalidArgument, match="need .* bytes"):
        await client.attach("m", GEOMETRY, 64, pool_fd=pool.fd)  # the pool holds only 4 pages
    await client.attach("m", GEOMETRY, 4, pool_fd=pool.fd)
    page = bytes(32)
    reply = await client.step(2, requests=CacheRequests(writes=(WriteRequest(1, [page], [0]),)))
    step = 2
    while 1 not in reply.write_acks:  # rounds until the write-through is agreed done
        step += 1
        reply = await client.step(step)
    before = await client.stats()
    bad = [
        (CacheRequests(writes=(WriteRequest(7, [b"short"], [0]),)), errors.InvalidArgument, "32-byte"),
        (CacheRequests(writes=(WriteRequest(7, [page], [0, 1]),)), errors.InvalidArgument, "device pages"),
        (CacheRequests(writes=(WriteRequest(7, [page], [4]),)), errors.InvalidArgument,
         "outside the attached pool of 4 pages"),
        (CacheRequests(prefetch_polls=(99,), revokes=(99,)), errors.InvalidArgument, "polled or revoked twice"),
        (CacheRequests(writes=(WriteRequest(2**63, [page], [0]),)), errors.InvalidArgument,
         "outside \\[0, 2\\*\\*63\\)"),
        (CacheRequests(revokes=(99,)), errors.NotFound, "prefetch 99 is not open"),
        (CacheRequests(loads=(LoadRequest(8, [bytes([1]) * 32], [1]),)), errors.NotFound, "is not in host"),
    ]
    for requests, kind, words in bad:
        step += 1  # a refused step still takes its number: its round ran, rejected
        with pytest.raises(kind, match=words):
            await client.step(step, requests=requests)
        after = await client.stats()
        assert after["cache_digest"] == before["cache_digest"], words
    # A full host pool is not an error: the write fails, alike on every rank, and nothing changes.
    step += 1
    overflow = [bytes([i]) * 32 for i in range(2, 2 + PAGES + 1)]
    reply = await client.step(step, requests=CacheRequests(writes=(WriteRequest(9, overflow, [0] * (PAGES + 1)),)))
    assert reply.write_failures == (9,) and not reply.write_acks
    assert (await client.stats())["host_pages_used"] == before["host_pages_used"]
    with pytest.raises(errors.FailedPrecondition, match="already taken with different content"):
        await client.step(1)
    # Still serving, and the page written before is still there to load.
    reply = await client.step(step + 1, requests=CacheRequests(loads=(LoadRequest(10, [page], [2]),)))
    await client.wait_loads([10], timeout_s=10)
    assert (await client.match([page, bytes([5]) * 32])).host_pages == 1
    del reply
    await client.close()


async def test_single_purpose_steps_are_one_round_each(single, run_dir):
    """Steps that carry one thing (a prefetch, a revoke, nothing: an ack)
    each take one round, as any step does."""
    import grpc

    from cpcache.v1 import daemon_pb2 as pb
    from cpcache.v1 import daemon_pb2_grpc as pb_grpc

    pool = DevicePool.create_sealed(GEOMETRY, 4)
    async with AsyncClient(single.sockets[0]) as client:
        await client.attach("m", GEOMETRY, 4, pool_fd=pool.fd)
    async with grpc.aio.insecure_channel("unix:" + single.sockets[0]) as channel:
        stub = pb_grpc.CacheDaemonStub(channel)
        page = bytes([7]) * 32
        reply = await stub.Step(pb.StepRequest(step=1, prefetches=[pb.PrefetchOp(op_id=4, pages=[page], tokens=16)]))
        assert reply.step == 1 and reply.round == 1
        reply = await stub.Step(pb.StepRequest(step=2, revokes=[4]))
        assert [(d.op_id, d.outcome) for d in reply.prefetches] == [(4, pb.PrefetchDecision.REVOKED)]
        reply = await stub.Step(pb.StepRequest(step=3))
        assert reply.round == 3
        reply = await stub.Step(pb.StepRequest(step=4, revokes=[4]))  # ended meanwhile: taken, ignored
        assert not reply.prefetches
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Step(pb.StepRequest(step=5, revokes=[5]))  # never opened
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        status = await stub.Status(pb.StatusRequest())
        assert status.rounds_completed == 5 and status.attached  # the rejected step ran its round too


async def test_a_storage_that_does_not_answer_is_an_agreed_miss_in_bounded_time(run_dir):
    """Rank 1's storage takes seconds to answer a lookup; the prefetch's hit
    is decided (a miss: 0 pages) after storage_timeout_s, the same on both ranks."""
    spec = DomainSpec(Topology(tp=2), run_dir,
                      extra=dict(storage="file", storage_root=str(run_dir / "pages"), storage_timeout_s=0.5),
                      # seed 6: rank 1's first lookup is delayed 3.66 s
                      per_rank={1: dict(fault_storage_delay_ms=4000.0)}, seed=6)
    async with LocalDomain(spec) as domain:
        clients, _, _ = await attach_all(domain, run_dir)
        import time

        started = time.monotonic()
        prefetch = PrefetchRequest(1, [bytes(32)], GEOMETRY.page_size)
        reply = await step_all(clients, 1, CacheRequests(prefetches=(prefetch,)))
        step = 1
        while 1 not in reply.prefetch_hits:
            step += 1
            reply = await step_all(clients, step)
        assert reply.prefetch_hits[1] == 0
        assert time.monotonic() - started < 3.0  # well before rank 1's lookup returns
        for c in clients:
            await c.close()


async def test_killed_mooncake_master_gives_agreed_misses_and_failures(run_dir):
    from cpcache.testing.mooncake_master import MooncakeMaster

    with MooncakeMaster(run_dir / "master.log") as master:
        spec = DomainSpec(Topology(tp=2), run_dir, extra=dict(
            storage="mooncake", storage_master=master.master, storage_metadata_server=master.metadata_server,
            storage_segment_bytes=16 << 20, storage_timeout_s=2.0))
        async with LocalDomain(spec) as domain:
            clients, pools, seed = await attach_all(domain, run_dir)
            before = [bytes([1, i]) * 16 for i in range(2)]
            after = [bytes([2, i]) * 16 for i in range(2)]
            step = 1
            reply = await step_all(clients, step, CacheRequests(writes=(WriteRequest(1, before, [0, 1]),)))
            stored = {}
            while not stored:  # write-through acked, then backed up to the store (backup ids are the daemon's)
                step += 1
                reply = await step_all(clients, step)
                stored.update({op: ok for op, ok in reply.backups.items()})
            assert list(stored.values()) == [True]
            master.stop()  # the store is gone
            step += 1
            await step_all(clients, step, CacheRequests(writes=(WriteRequest(2, after, [2, 3]),),
                                              prefetches=(PrefetchRequest(3, [bytes([3]) * 32], GEOMETRY.page_size),)))
            hits, backups = {}, {}
            while 3 not in hits or len(backups) < 1:
                step += 1
                reply = await step_all(clients, step)  # identical on both ranks, every step
                hits.update(reply.prefetch_hits)
                backups.update(reply.backups)
            assert hits[3] == 0  # the store is gone: an agreed miss
            assert list(backups.values()) == [False]  # an agreed failure, not a hang
            assert (await clients[0].status()).state == "serving"
            for c in clients:
                await c.close()
