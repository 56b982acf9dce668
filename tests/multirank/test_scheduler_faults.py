"""Agreement under scheduler-side faults (docs/design.md rules 6 to 9), on real
daemons: a call cancelled mid-round, a step only one rank rejects, ranks sent
different cache operations, device pages outside one rank's pool, retries.
Every rank ends each step with the same answer and the domain goes on."""

import asyncio

import grpc
import numpy as np
import pytest

from cpcache import errors
from cpcache.client import AsyncClient, CacheRequests, LoadRequest, PrefetchRequest, WriteRequest
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.dataplane.pools import DevicePool
from cpcache.testing.sim.pages import page_content
from cpcache.topology import Topology
from cpcache.v1 import daemon_pb2 as pb
from cpcache.v1 import daemon_pb2_grpc as pb_grpc
from cpcache.values import Reduce
from tests.multirank.test_cache_ops import GEOMETRY, read_page, write_page

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(90)]

TIMEOUT_S = 3.0
VOTE = [(1, Reduce.MIN, 5)]


def spec(run_dir, lag=0, **extra):
    return DomainSpec(Topology(tp=2), run_dir, agreement_timeout_s=TIMEOUT_S, agreement_lag=lag,
                      extra=dict(storage="file", storage_root=str(run_dir / "pages"), host_pool_pages=16, **extra))


async def attach(domain, run_dir, device_pages=(8, 8)):
    clients, _ = await attach_pools(domain, run_dir, device_pages)
    return clients


async def attach_pools(domain, run_dir, device_pages=(8, 8)):
    """Attach every rank at once: Attach is agreed across the domain."""
    clients = [AsyncClient(s) for s in domain.sockets]
    pools = [DevicePool.create_sealed(GEOMETRY, n) for n in device_pages]
    await asyncio.gather(*(c.attach("m", GEOMETRY, n, pool_fd=p.fd) for c, p, n in zip(clients, pools, device_pages)))
    return clients, pools


async def both(clients, step, per_rank):
    return await asyncio.gather(*(c.step(step, *args) for c, args in zip(clients, per_rank)), return_exceptions=True)


async def drain_lag(clients, step, lag):
    """Steps that carry the rounds still in the pipeline; returns their results."""
    results = []
    for i in range(lag):
        results = await both(clients, step + 1 + i, [(VOTE,)] * len(clients))
    return results


async def test_a_cancelled_call_changes_nothing_about_the_outcome(run_dir):
    async with LocalDomain(spec(run_dir)) as domain:
        hasty = AsyncClient(domain.sockets[0], timeout_s=0.3)
        late = AsyncClient(domain.sockets[1])
        with pytest.raises(errors.Unavailable):  # rank 0's deadline fires while rank 1 is not there yet
            await hasty.step(1, VOTE)
        reply_1 = await late.step(1, VOTE)
        patient = AsyncClient(domain.sockets[0])
        retried = await patient.step(1, VOTE)  # a retry: the outcome the daemon kept
        assert retried.wire == reply_1.wire and retried.decisions == {1: 5}
        after = await both([patient, late], 2, [(VOTE,)] * 2)
        assert not any(isinstance(r, Exception) for r in after), after
        assert after[0].wire == after[1].wire
        for c in (hasty, late, patient):
            await c.close()


@pytest.mark.parametrize("lag", [0, 1])
async def test_a_step_one_rank_rejects_is_rejected_everywhere_and_the_domain_goes_on(run_dir, lag):
    async with LocalDomain(spec(run_dir, lag)) as domain:
        clients = [AsyncClient(s) for s in domain.sockets]
        channel = grpc.aio.insecure_channel("unix:" + domain.sockets[0])
        bad = pb.StepRequest(step=1, votes=pb.Votes(op_ids=[1, 1], reduces=[pb.REDUCE_MIN] * 2, values=[1, 2]))
        results = await asyncio.gather(pb_grpc.CacheDaemonStub(channel).Step(bad), clients[1].step(1, VOTE),
                                       return_exceptions=True)
        if lag:
            assert not any(isinstance(r, BaseException) for r in results), results  # the pipeline fills
            results = await both(clients, 2, [(VOTE,)] * 2)
        own, peer = results
        assert isinstance(own, (grpc.aio.AioRpcError, errors.InvalidArgument)), own
        assert isinstance(peer, errors.RejectedByPeer), peer
        assert peer.rank == 0 and peer.peer_status == "INVALID_ARGUMENT" and "appears twice" in peer.peer_message
        later = await both(clients, 10, [(VOTE,)] * 2)
        later += await drain_lag(clients, 10, lag)
        assert not any(isinstance(r, Exception) for r in later), later
        assert later[-1].wire == later[-2].wire
        await channel.close()
        for c in clients:
            await c.close()


@pytest.mark.parametrize("lag", [0, 1])
async def test_ranks_sent_different_cache_operations_diverge_everywhere_and_open_nothing(run_dir, lag):
    async with LocalDomain(spec(run_dir, lag)) as domain:
        clients = await attach(domain, run_dir)
        page = bytes([3]) * 32
        loop = asyncio.get_running_loop()
        started = loop.time()
        results = await both(clients, 1, [((), CacheRequests(writes=(WriteRequest(7, [page], [0]),))), ((), None)])
        if lag:
            results = await both(clients, 2, [((), None)] * 2)
        assert loop.time() - started < TIMEOUT_S + 1
        for result in results:
            assert isinstance(result, errors.Divergence), result
            assert "write 7" in str(result)
        later = await both(clients, 10, [((), None)] * 2)
        later += await drain_lag(clients, 10, lag)
        assert not any(isinstance(r, Exception) for r in later), later
        stats = [await c.stats() for c in clients]
        assert stats[0]["cache_digest"] == stats[1]["cache_digest"] and stats[0]["open_writes"] == 0
        for c in clients:
            await c.close()


async def test_mismatched_pools_fail_attach_on_every_rank_and_nothing_is_attached(run_dir):
    async with LocalDomain(spec(run_dir)) as domain:
        clients = [AsyncClient(s) for s in domain.sockets]
        pools = [DevicePool.create_sealed(GEOMETRY, pages) for pages in (8, 4)]
        results = await asyncio.gather(*(c.attach("m", GEOMETRY, n, pool_fd=p.fd)
                                         for c, p, n in zip(clients, pools, (8, 4))), return_exceptions=True)
        for result in results:
            assert isinstance(result, errors.FailedPrecondition), result
            assert "differ in device_pages" in str(result) and "ranks [0]" in str(result) and "ranks [1]" in str(result)
        assert not any([(await c.status()).attached for c in clients])
        # The scheduler fixes its pools and attaches again: every rank agrees this time.
        pools[1] = DevicePool.create_sealed(GEOMETRY, 8)
        await asyncio.gather(*(c.attach("m", GEOMETRY, 8, pool_fd=p.fd) for c, p in zip(clients, pools)))
        results = await both(clients, 1, [((), CacheRequests(writes=(WriteRequest(1, [bytes([1]) * 32], [9]),)))] * 2)
        assert all(isinstance(r, errors.InvalidArgument) for r in results)  # device page 9 of 8: refused alike
        for c in clients:
            await c.close()


async def test_an_attach_one_rank_never_sends_fails_naming_it(run_dir):
    async with LocalDomain(spec(run_dir)) as domain:
        client = AsyncClient(domain.sockets[0])
        pool = DevicePool.create_sealed(GEOMETRY, 8)
        with pytest.raises(errors.Unavailable, match=r"ranks \[1\] did not attach"):
            await client.attach("m", GEOMETRY, 8, pool_fd=pool.fd)
        assert not (await client.status()).attached
        await client.close()


async def test_lag1_write_acks_wait_for_slow_copies_and_load_back_exact_bytes(run_dir):
    """Rank 1's device -> host copies are slow. At lag 1 the ack must still
    wait for them: the scheduler reuses the device pages as soon as it sees
    the ack, and a later load must bring back the bytes written, on every rank."""
    async with LocalDomain(DomainSpec(
            Topology(tp=2), run_dir, agreement_timeout_s=TIMEOUT_S, agreement_lag=1,
            extra=dict(storage="file", storage_root=str(run_dir / "pages"), host_pool_pages=16),
            per_rank={1: dict(fault_copy_delay_ms=400.0)})) as domain:
        clients, pools = await attach_pools(domain, run_dir)
        pages = [bytes([5, i]) * 16 for i in range(3)]
        written = []
        for rank, pool in enumerate(pools):
            contents = [page_content(f"{p.hex()}-{rank}", GEOMETRY.page_bytes) for p in pages]
            for i, content in enumerate(contents):
                write_page(pool, i, content)
            written.append(contents)
        step = 1
        await both(clients, step, [((), CacheRequests(writes=(WriteRequest(1, pages, [0, 1, 2]),)))] * 2)
        acked = False
        while not acked:
            step += 1
            replies = await both(clients, step, [((), None)] * 2)
            assert not any(isinstance(r, Exception) for r in replies), replies
            assert replies[0].wire == replies[1].wire
            acked = 1 in replies[0].write_acks
        for pool in pools:  # acked: the scheduler may reuse its device pages at once
            for i in range(3):
                write_page(pool, i, np.zeros(GEOMETRY.page_bytes, dtype=np.uint8))
        step += 1
        await both(clients, step, [((), CacheRequests(loads=(LoadRequest(2, pages, [4, 5, 6]),)))] * 2)
        loaded = False
        while not loaded:
            step += 1
            replies = await both(clients, step, [((), None)] * 2)
            loaded = 2 in replies[0].loads
        for rank, (client, pool) in enumerate(zip(clients, pools)):
            await client.wait_loads([2], timeout_s=10)
            for i in range(3):
                assert np.array_equal(read_page(pool, 4 + i), written[rank][i]), f"rank {rank} page {i}"
        for c in clients:
            await c.close()


async def test_a_failed_copy_is_an_agreed_write_failure(run_dir):
    async with LocalDomain(DomainSpec(
            Topology(tp=2), run_dir, agreement_timeout_s=TIMEOUT_S,
            extra=dict(storage="file", storage_root=str(run_dir / "pages"), host_pool_pages=16),
            per_rank={1: dict(fault_copy_fail_rate=1.0)})) as domain:
        clients, _ = await attach_pools(domain, run_dir)
        page = bytes([6]) * 32
        replies = await both(clients, 1, [((), CacheRequests(writes=(WriteRequest(1, [page], [0]),)))] * 2)
        step = 1
        while not any(1 in r.write_failures for r in replies):
            assert not any(1 in r.write_acks for r in replies), "a write whose copy failed was acknowledged"
            step += 1
            replies = await both(clients, step, [((), None)] * 2)
        assert replies[0].wire == replies[1].wire
        stats = [await c.stats() for c in clients]
        assert stats[0]["host_pages_used"] == stats[1]["host_pages_used"] == 0
        assert stats[0]["host_pages_free"] == 16  # the slots came back: every rank's copy had ended
        assert (await clients[0].match([page])).host_pages == 0
        for c in clients:
            await c.close()


async def test_a_hung_store_does_not_hold_write_throughs(run_dir):
    """Rank 1's storage calls take seconds and it has one I/O thread per
    executor: its lookups occupy the storage thread, yet a write-through is
    acknowledged while those lookups are still unanswered."""
    async with LocalDomain(DomainSpec(
            Topology(tp=2), run_dir, agreement_timeout_s=TIMEOUT_S,
            extra=dict(storage="file", storage_root=str(run_dir / "pages"), host_pool_pages=16, io_threads=1,
                       storage_timeout_s=30.0),
            per_rank={1: dict(fault_storage_delay_ms=20_000.0, fault_seed=1)})) as domain:
        clients, _ = await attach_pools(domain, run_dir)
        lookups = tuple(PrefetchRequest(10 + i, [bytes([7, i]) * 16], GEOMETRY.page_size) for i in range(3))
        await both(clients, 1, [((), CacheRequests(prefetches=lookups))] * 2)
        await both(clients, 2, [((), CacheRequests(writes=(WriteRequest(1, [bytes([8]) * 32], [0]),)))] * 2)
        step, hits, acked = 2, {}, False
        while not acked:
            step += 1
            replies = await both(clients, step, [((), None)] * 2)
            assert not any(isinstance(r, Exception) for r in replies), replies
            hits.update(replies[0].prefetch_hits)
            acked = 1 in replies[0].write_acks
        assert not hits, "the write waited for the hung lookups"
        for c in clients:
            await c.close()


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("kind", ["prefetch", "poll", "revoke", "write", "load"])
async def test_a_cache_operation_sent_to_one_rank_only_diverges_everywhere_in_bounded_time(run_dir, kind, lag):
    async with LocalDomain(spec(run_dir, lag, prefetch_threshold_tokens=0)) as domain:
        clients, _ = await attach_pools(domain, run_dir)
        page, step = bytes([4]) * 32, 0

        async def agreed(requests=None):
            nonlocal step
            step += 1
            replies = await both(clients, step, [((), requests)] * 2)
            assert not any(isinstance(r, Exception) for r in replies), replies
            return replies[0]

        # stays open: threshold 0
        await agreed(CacheRequests(prefetches=(PrefetchRequest(5, [bytes([9]) * 32], GEOMETRY.page_size),)))
        await agreed(CacheRequests(writes=(WriteRequest(6, [page], [0]),)))
        while 6 not in (await agreed()).write_acks:
            pass
        odd = {"prefetch": CacheRequests(prefetches=(PrefetchRequest(7, [bytes([8]) * 32], GEOMETRY.page_size),)),
               "poll": CacheRequests(prefetch_polls=(5,)),
               "revoke": CacheRequests(revokes=(5,)),
               "write": CacheRequests(writes=(WriteRequest(7, [bytes([7]) * 32], [1]),)),
               "load": CacheRequests(loads=(LoadRequest(7, [page], [2]),))}[kind]
        before = [(await c.stats())["cache_digest"] for c in clients]
        loop = asyncio.get_running_loop()
        started = loop.time()
        step += 1
        results = await both(clients, step, [((), odd), ((), None)])
        if lag:
            step += 1
            results = await both(clients, step, [((), None)] * 2)
        assert loop.time() - started < TIMEOUT_S + 1
        for result in results:
            assert isinstance(result, errors.Divergence), result
            assert f"[{kind} " in str(result), str(result)
        after = [(await c.stats())["cache_digest"] for c in clients]
        assert after[0] == after[1]
        if not lag:
            assert after == before  # nothing of the step was opened anywhere
        await agreed()
        for c in clients:
            await c.close()


async def test_a_host_pool_past_the_budget_is_refused_before_it_is_allocated(run_dir):
    async with LocalDomain(spec(run_dir, host_pool_max_bytes=1000)) as domain:
        clients = [AsyncClient(s) for s in domain.sockets]
        pools = [DevicePool.create_sealed(GEOMETRY, 8) for _ in range(2)]
        results = await asyncio.gather(*(c.attach("m", GEOMETRY, 8, pool_fd=p.fd) for c, p in zip(clients, pools)),
                                       return_exceptions=True)
        for result in results:
            assert isinstance(result, errors.ResourceExhausted) and "host_pool_max_bytes" in str(result), result
        assert (await clients[0].stats()).get("host_pages_free") is None  # nothing attached
        for c in clients:
            await c.close()


async def test_at_lag_1_a_load_of_pages_evicted_since_the_scheduler_saw_them_fails_alone(run_dir):
    """At lag >= 1 the host pool moves between what a scheduler was told and
    its step's round: a load of pages evicted meanwhile is an agreed load
    failure when its step opens, not a step refused."""
    async with LocalDomain(spec(run_dir, lag=1)) as domain:  # 16 host pages
        clients = await attach(domain, run_dir, device_pages=(32, 32))
        old = [bytes([1, i]) + bytes(30) for i in range(16)]
        new = [bytes([2, i]) + bytes(30) for i in range(16)]
        replies = await both(clients, 1, [(VOTE, CacheRequests(writes=(WriteRequest(1, old, list(range(16))),)))] * 2)
        step, acked, backed_up = 1, False, False
        while not (acked and backed_up):  # then no operation holds `old`: it may be evicted
            step += 1
            assert step < 100, replies
            replies = await both(clients, step, [(VOTE,)] * 2)
            acked = acked or 1 in replies[0].write_acks
            backed_up = backed_up or bool(replies[0].backups)
        assert (await clients[0].match(old)).host_pages == 16  # what the scheduler was told
        # The write of `new` opens when the next step is taken, evicting `old`; that step loads `old`.
        await both(clients, step + 1, [(VOTE, CacheRequests(writes=(WriteRequest(2, new, list(range(16))),)))] * 2)
        load_old = CacheRequests(loads=(LoadRequest(3, old, list(range(16, 32))),))
        loading = await both(clients, step + 2, [(VOTE, load_old)] * 2)
        carried = await both(clients, step + 3, [(VOTE,)] * 2)
        for r in (*loading, *carried):
            assert not isinstance(r, Exception), r
        assert carried[0].wire == carried[1].wire

        assert carried[0].load_failures == (3,) and 3 not in carried[0].loads
        assert set(old) <= set(carried[0].host_left + loading[0].host_left)
        later = await both(clients, step + 4, [(VOTE,)] * 2)
        assert not any(isinstance(r, Exception) for r in later) and later[0].wire == later[1].wire
        for c in clients:
            await c.close()
