"""Why hits were lost, through real daemons (2 ranks, real gloo, real gRPC,
file storage): prefetches that miss, fall below the threshold, are revoked,
end short of a slow rank's reads and of a damaged page, and one that is
accepted and loaded. Each rank's lost-hit counters match what the
scheduler was told (the agreed hits and ends), and with the hits they add
up to the pages asked (docs/operations.md, "Why a hit was lost")."""

import pytest

from cpcache.client import CacheRequests, LoadRequest, PrefetchRequest
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.dataplane.storage import PageBuffer, open_backend
from cpcache.dataplane.storage.framing import HEADER
from cpcache.keys import ShardingSpec, chain, tenant_of
from cpcache.testing.sim.pages import page_content
from cpcache.topology import Topology
from tests.multirank.test_cache_ops import GEOMETRY, attach_all, step_all

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(120)]

REASONS = ("storage_miss", "below_threshold", "host_full", "revoked", "prefetch_late", "read_failed")


def store(run_dir, hashes: list[str], damaged: dict[int, int] | None = None) -> None:
    """Both ranks' copies of `hashes` in storage; `damaged`: rank -> the page whose file gets a flipped bit."""
    for rank in range(2):
        backend = open_backend("file", root=str(run_dir / "pages"), geometry_fingerprint=GEOMETRY.fingerprint())
        sharding = ShardingSpec(tp_rank=rank, tp_size=2, tenant=tenant_of("test-model", GEOMETRY.fingerprint()))
        keys = [sharding.storage_key(p) for p in hashes]
        buffers = [PageBuffer(0, page_content(key, GEOMETRY.page_bytes)) for key in keys]
        assert backend.put_from(keys, buffers) == [True] * len(keys)
        if damaged and rank in damaged:
            with open(backend.path(keys[damaged[rank]]), "r+b") as fh:
                fh.seek(HEADER.size + 7)
                byte = fh.read(1)[0]
                fh.seek(HEADER.size + 7)
                fh.write(bytes([byte ^ 1]))


async def test_lost_hit_counters_match_the_agreed_answers_and_add_up_to_the_pages_asked(run_dir):
    spec = DomainSpec(Topology(tp=2), run_dir, extra=dict(storage="file", storage_root=str(run_dir / "pages"),
                                                          host_pool_pages=16, prefetch_threshold_tokens=32),
                      per_rank={1: dict(fault_storage_delay_ms=400.0)})  # rank 1's storage is slow
    async with LocalDomain(spec) as domain:
        clients, _pools, seed = await attach_all(domain, run_dir)
        ps = GEOMETRY.page_size
        chains = {op: [bytes.fromhex(h) for h in chain([op] * 8 * ps, ps, seed)] for op in (1, 2, 3, 4)}
        store(run_dir, [p.hex() for p in chains[1][:6]], damaged={0: 4})  # 6 of 8 stored, rank 0's 5th damaged
        store(run_dir, [p.hex() for p in chains[2][:1]])  # 1 page: 16 tokens, below the threshold
        store(run_dir, [p.hex() for p in chains[3][:3]])
        hits: dict[int, int] = {}
        done: dict[int, int] = {}
        revoked: set[int] = set()
        step = 1
        opened = CacheRequests(prefetches=tuple(PrefetchRequest(op, chains[op], 8 * ps) for op in (1, 2, 3, 4)))
        polls: tuple[int, ...] = ()
        while len(done) + len(revoked) < 4:
            # 4 is revoked by the scheduler in the next step (its request aborted), most likely before
            # rank 1's slow lookup answered; the others are polled as soon as their hit is known.
            requests = opened if step == 1 else CacheRequests(revokes=(4,) if step == 2 else (),
                                                              prefetch_polls=polls)
            reply = await step_all(clients, step, requests)
            step += 1
            hits.update(reply.prefetch_hits)
            done.update(reply.prefetch_done)
            revoked.update(reply.prefetch_revoked)
            # 3 is polled once slow rank 1 has read its pages (and 1's 6): it is accepted whole.
            read = (await clients[1].stats()).get("pages_moved_storage_to_host", 0) if 3 in hits else 0
            polls = tuple(op for op in (1, 3) if op in hits and op not in done and (op == 1 or read >= 6 + 3))
        assert {op: hits[op] for op in (1, 2, 3)} == {1: 6, 2: 1, 3: 3} and revoked == {2, 4}
        assert done[1] <= 4 and done[3] == 3  # rank 0's read of 1 stopped at its damaged page
        await step_all(clients, step, CacheRequests(loads=(LoadRequest(5, chains[3][:done[3]], list(range(done[3]))),)))
        for c in clients:
            await c.wait_loads([5], timeout_s=10)
        stats = [await c.stats() for c in clients]
        for c in clients:
            await c.close()
    # 4 ended with its hit agreed (of 0: nothing of it is stored) only if both lookups beat the revoke.
    miss, lost_revoked = 2 + 7 + 5 + (8 if 4 in hits else 0), 0 if 4 in hits else 8
    short = {op: hits[op] - done[op] for op in (1, 3)}
    for rank, s in enumerate(stats):
        lost = {r: s[f"lost_hit_pages_{r}"] for r in REASONS}
        assert {r: lost[r] for r in REASONS[:4]} == {"storage_miss": miss, "below_threshold": 1, "host_full": 0,
                                                     "revoked": lost_revoked}
        # The pages the prefetches ended without, each rank's split: rank 0's read of 1 failed at the
        # damaged page (unless the wait ran out first on a loaded host); rank 1, slow, had not read them.
        assert lost["prefetch_late"] + lost["read_failed"] == short[1] + short[3]
        assert lost["read_failed"] in ((short[1], 0) if rank == 0 else (0,))
        assert s["prefetches_short"] == sum(1 for n in short.values() if n)
        assert s["storage_hit_pages"] == done[1] + done[3] and s["prefetch_resident_pages"] == 0
        assert s["prefetch_asked_pages"] == 4 * 8 == s["storage_hit_pages"] + s["prefetch_resident_pages"] + sum(
            lost.values())
        assert s["host_hit_pages"] == done[3] and s["lost_hit_pages_host_evicted"] == 0
    assert stats[0]["storage_damaged_pages_deleted"] == 1
    assert stats[1]["cache_digest"] == stats[0]["cache_digest"]
