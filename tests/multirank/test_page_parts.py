"""Pages with a part beside their KV (DeepSeek V3.2's indexer keys and
scales) through real daemons: a page is moved and stored whole, and a page
that lost its indexer bytes in storage is a miss on every rank of the
domain, never a hit with another prefix's index.

The model is MLA (the latent is replicated over attention TP: one stored
object per page, no shard suffix). Each rank has its own file storage here,
so one rank's copy of a page can lose its part while the other's is whole:
the hit both ranks are given is the shorter one."""

import asyncio
import os

import numpy as np
import pytest
import torch

from cpcache.client import AsyncClient, CacheRequests, LoadRequest, PrefetchRequest
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.dataplane.pools import DevicePool
from cpcache.dataplane.storage import PageBuffer, open_backend
from cpcache.geometry import KVGeometry, PagePart
from cpcache.keys import ShardingSpec, chain, tenant_of
from cpcache.testing.sim.pages import page_content
from cpcache.topology import Topology

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(120)]

PAGE = 16
INDEXER = PagePart("indexer", rows_per_page=1, width=PAGE * 132, dtype="uint8")  # keys, then scales
GEOMETRY = KVGeometry(layers=2, kv_kind="mla", heads=1, head_dim=48, dtype="bfloat16", page_size=PAGE,
                      beside=(INDEXER,))
PAGES = 6
LOST = 3  # the page whose indexer bytes rank 0's storage loses
MODEL = "dsa-model"


def page_bytes_of(pool: DevicePool, device_page: int) -> bytes:
    """A device page as stored: each part's [components, layers, rows, heads, head_dim], one after another."""
    out = b""
    for part in pool.parts:
        layers = [part.layer_pages(layer, device_page) for layer in range(part.geometry.layers)]
        out += torch.stack(layers).transpose(0, 1).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return out


async def step_all(clients, step, requests=None):
    replies = await asyncio.gather(*(c.step(step, requests=requests) for c in clients))
    assert len({r.wire for r in replies}) == 1, f"step {step}: the ranks were given different answers"
    return replies[0]


@pytest.mark.parametrize("fault", ["lost", "damaged"])
async def test_a_page_missing_its_indexer_part_on_one_rank_is_a_miss_on_every_rank(run_dir, fault):
    """`lost`: the object ends before its indexer bytes (found short at
    lookup: storage holds LOST pages). `damaged`: one indexer byte differs
    (found at read: the checksum covers every part, and the page is deleted)."""
    roots = [run_dir / f"pages-{rank}" for rank in range(2)]
    spec = DomainSpec(Topology(tp=2), run_dir,
                      extra=dict(storage="file", host_pool_pages=PAGES, prefetch_threshold_tokens=0),
                      per_rank={rank: dict(storage_root=str(root)) for rank, root in enumerate(roots)})
    async with LocalDomain(spec) as domain:
        clients = [AsyncClient(socket) for socket in domain.sockets]
        pools = [DevicePool.create_sealed(GEOMETRY, 2 * PAGES) for _ in clients]
        replies = await asyncio.gather(*(c.attach(MODEL, GEOMETRY, 2 * PAGES, pool_fd=pool.fd)
                                         for c, pool in zip(clients, pools)))
        assert replies[0].page_bytes == GEOMETRY.page_bytes
        pages = chain(list(range(PAGES * PAGE)), PAGE, replies[0].key_seed)
        tenant = tenant_of(MODEL, GEOMETRY.fingerprint())
        keys, peer_keys = ([ShardingSpec(tp_rank=rank, tp_size=2, tp_sharded_heads=False, tenant=tenant).storage_key(p)
                            for p in pages] for rank in range(2))
        assert keys == peer_keys  # the latent is replicated: one object per page, whichever rank reads it
        stored = [page_content(k, GEOMETRY.page_bytes) for k in keys]
        for root in roots:  # as a peer wrote them: every part of every page
            backend = open_backend("file", root=str(root), geometry_fingerprint=GEOMETRY.fingerprint())
            assert backend.put_from(keys, [PageBuffer(0, page) for page in stored]) == [True] * PAGES
            backend.close()
        # Rank 0's copy of page LOST loses its indexer bytes (the part after the KV), or one of them differs.
        backend = open_backend("file", root=str(roots[0]), geometry_fingerprint=GEOMETRY.fingerprint())
        path = backend.path(keys[LOST])
        backend.close()
        size = os.path.getsize(path)
        if fault == "lost":
            os.truncate(path, size - GEOMETRY.parts[1].page_bytes)
        else:
            with open(path, "r+b") as f:
                f.seek(size - GEOMETRY.parts[1].page_bytes // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))

        hashes = [bytes.fromhex(p) for p in pages]
        step = 1
        await step_all(clients, step, CacheRequests(prefetches=(PrefetchRequest(1, hashes, PAGES * PAGE),)))
        hit = None
        while hit is None:
            step += 1
            hit = (await step_all(clients, step)).prefetch_hits.get(1)
        assert hit == (LOST if fault == "lost" else PAGES)  # a damaged page is found only when read

        done = None
        while done is None:  # the agreed pages land in the host pools; poll until the prefetch ends
            step += 1
            done = (await step_all(clients, step, CacheRequests(prefetch_polls=(1,)))).prefetch_done.get(1)
        assert done == LOST  # rank 1 holds every page whole; neither rank is given page LOST
        # The pages given are whole on both ranks: load them and compare every part's bytes.
        step += 1
        await step_all(clients, step, CacheRequests(loads=(LoadRequest(2, hashes[:LOST], list(range(LOST))),)))
        await asyncio.gather(*(c.wait_loads([2], timeout_s=30) for c in clients))
        for pool in pools:
            for i in range(LOST):
                assert page_bytes_of(pool, i) == stored[i].tobytes(), f"page {i}"
            assert not np.frombuffer(page_bytes_of(pool, LOST), dtype=np.uint8).any()  # never loaded
        if fault == "damaged":
            stats = [await c.stats() for c in clients]
            assert stats[0]["storage_damaged_pages_deleted"] == 1
            assert not os.path.exists(path)  # the damaged page is gone, not read again
        for c in clients:
            await c.close()
