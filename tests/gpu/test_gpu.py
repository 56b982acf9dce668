"""GPU tests: CUDA IPC attach, a pinned host pool, bit-exact device <-> host
movers for every layout, and a two-process domain on one GPU. Skipped where
CUDA is absent; `services/gpu-driver/run.sh` runs them on a GPU host."""

import pytest
import torch

from cpcache.client import AsyncClient, Ops
from cpcache.dataplane.movers import DEVICE, HOST, Tiers, Transfers
from cpcache.dataplane.pools import LAYOUTS, DevicePool, HostPool
from cpcache.geometry import KVGeometry
from cpcache.tools.launcher import DomainSpec, LocalDomain
from cpcache.topology import Topology

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(120),
]

GEOMETRY = KVGeometry(layers=4, kv_kind="mha", heads=8, head_dim=128, dtype="bfloat16", page_size=16)


def cuda_pool(pages: int) -> torch.Tensor:
    pool = torch.empty(GEOMETRY.pool_shape(pages), dtype=GEOMETRY.torch_dtype, device="cuda")
    pool.view(torch.int16).random_(-(2**15), 2**15 - 1)
    return pool


def ipc_handle(tensor: torch.Tensor) -> dict:
    """The fields of `_share_cuda_()`, as the Attach message carries them."""
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
        tensor.untyped_storage()._share_cuda_()
    )
    return dict(device=device, handle=handle, storage_size=size, storage_offset=offset,
                ref_counter_handle=ref_handle, ref_counter_offset=ref_offset, event_handle=event_handle,
                event_sync_required=event_sync)


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
    pages = [bytes([i]) * 32 for i in range(4)]
    await client.step(step, ops=Ops(writes=((1, pages, [0, 1, 2, 3]),)))
    while 1 not in (await client.step(step + 1)).write_acks:
        step += 1
    step += 2
    await client.step(step, ops=Ops(loads=((2, pages, [8, 9, 10, 11]),)))
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
