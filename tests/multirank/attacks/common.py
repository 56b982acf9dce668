"""Shared helpers for the attacks: schedulers with sealed pools on a 2-rank domain."""
import asyncio

import numpy as np
import torch

from cpcache.client import AsyncClient, CacheRequests, WriteRequest
from cpcache.daemon.launcher import DomainSpec
from cpcache.dataplane.pools import DevicePool
from cpcache.geometry import KVGeometry
from cpcache.topology import Topology
from cpcache.values import Reduce

GEOMETRY = KVGeometry(layers=2, kv_kind="mha", heads=1, head_dim=8, dtype="bfloat16", page_size=4)
OTHER_GEOMETRY = KVGeometry(layers=2, kv_kind="mha", heads=1, head_dim=8, dtype="bfloat16", page_size=8)
TIMEOUT_S = 2.0
PAGES = 6
PAGE_HASHES = [bytes([7]) * 31 + bytes([i]) for i in range(PAGES)]


def spec(run_dir, lag=0, per_rank=None, **extra):
    return DomainSpec(Topology(tp=2), run_dir, agreement_timeout_s=TIMEOUT_S, agreement_lag=lag,
                      per_rank=per_rank or {},
                      extra=dict(host_pool_pages=32, rendezvous_timeout_s=20.0, **extra))


class Scheduler:
    """One rank's scheduler: its client and its device pool (a new one per life)."""

    def __init__(self, socket, geometry=GEOMETRY):
        self.client = AsyncClient(socket)
        self.pool = DevicePool.create_sealed(geometry, 16)
        self.geometry = geometry

    def fill(self, page, rank):
        view = self.pool.page_view(page)
        data = np.random.default_rng(page * 10 + rank).integers(0, 256, view.numel() * 2, dtype=np.uint8)
        view.copy_(torch.from_numpy(data).view(view.dtype).view(view.shape))

    def read(self, page):
        return self.pool.page_view(page).contiguous().view(-1).view(torch.uint8).numpy().copy()


def make(domain, run_dir, life, geometries=None):
    return [Scheduler(s, (geometries or {}).get(rank, GEOMETRY)) for rank, s in enumerate(domain.sockets)]


async def attach_all(schedulers, model="m", return_exceptions=False):
    return await asyncio.gather(*(s.client.attach(model, s.geometry, 16, pool_fd=s.pool.fd) for s in schedulers),
                                return_exceptions=return_exceptions)


async def step_all(schedulers, step, requests=None, return_exceptions=False):
    return await asyncio.gather(*(s.client.step(step, [(1, Reduce.MIN, 1)], requests=requests) for s in schedulers),
                                return_exceptions=return_exceptions)


async def write_through(schedulers, step):
    for rank, s in enumerate(schedulers):
        for page in range(PAGES):
            s.fill(page, rank)
    expected = [[s.read(page) for page in range(PAGES)] for s in schedulers]
    write = WriteRequest(1, PAGE_HASHES, list(range(PAGES)))
    replies = await step_all(schedulers, step, CacheRequests(writes=(write,)))
    assert len({r.wire for r in replies}) == 1
    while 1 not in replies[0].write_acks:
        step += 1
        replies = await step_all(schedulers, step)
        assert len({r.wire for r in replies}) == 1
    return step, expected


async def close_all(schedulers):
    for s in schedulers:
        await s.client.close()
