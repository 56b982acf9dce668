"""GPU tests: CUDA IPC attach, a pinned host pool, bit-exact device <-> host
movers for every layout, and a two-process domain on one GPU. Skipped where
CUDA is absent; `services/gpu-driver/run.sh` runs them on a GPU host."""

import pytest
import torch

from cpcache.client import AsyncClient
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.dataplane.movers import DEVICE, HOST, Tiers, Transfers
from cpcache.dataplane.pools import LAYOUTS, DevicePool, HostPool
from cpcache.topology import Topology
from tests.gpu.cuda import GEOMETRY, cuda_pool, ipc_handle, start_load, write_pages

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(120),
]

def test_host_pool_is_pinned():
    assert HostPool(GEOMETRY, pages=4).tensor.is_pinned()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_host_movers_are_bit_exact(layout):
    device = DevicePool(GEOMETRY, cuda_pool(32))
    original = device.tensor.clone()
    host = HostPool(GEOMETRY, pages=16, layout=layout)
    transfers = Transfers(Tiers(host, device), threads=2)
    pages, slots = [3, 4, 5, 20, 31], [0, 1, 2, 9, 15]
    assert transfers.submit((DEVICE, HOST), pages, slots).result().success
    device.tensor.zero_()
    assert transfers.submit((HOST, DEVICE), slots, pages).result().success
    s = GEOMETRY.page_size
    for p in pages:
        assert torch.equal(device.tensor[:, :, p * s:(p + 1) * s], original[:, :, p * s:(p + 1) * s])
    transfers.close()


async def round_trip(client: AsyncClient, pool: torch.Tensor, step: int) -> int:
    step = await write_pages(client, step, [0, 1, 2, 3])
    step = await start_load(client, step, [8, 9, 10, 11])
    await client.wait_loads([2], timeout_s=30)
    s = GEOMETRY.page_size
    assert torch.equal(pool[:, :, 8 * s:12 * s], pool[:, :, 0:4 * s])
    return step


async def test_cuda_ipc_attach_and_round_trip(run_dir):
    pool = cuda_pool(16)
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir, extra=dict(host_pool_pages=16))) as domain:
        async with AsyncClient(domain.sockets[0]) as client:
            await client.attach("gpu-test", GEOMETRY, 16, cuda_ipc=ipc_handle(pool))
            await round_trip(client, pool, 1)


async def test_two_process_domain_on_one_gpu(run_dir):
    pools = [cuda_pool(16), cuda_pool(16)]
    async with LocalDomain(DomainSpec(Topology(tp=2), run_dir, extra=dict(host_pool_pages=16))) as domain:
        clients = [AsyncClient(s) for s in domain.sockets]
        import asyncio

        await asyncio.gather(*(c.attach("gpu-test", GEOMETRY, 16, cuda_ipc=ipc_handle(p))
                               for c, p in zip(clients, pools)))

        await asyncio.gather(*(round_trip(c, p, 1) for c, p in zip(clients, pools)))
        for c in clients:
            await c.close()
