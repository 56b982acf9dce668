"""GPU tests: CUDA IPC attach of per-layer KV buffers (an IPC handle per
layer, as SGLang's pool is shared where it lies) and of one contiguous
pool, a pinned host pool, bit-exact device <-> host movers for every layout
over per-layer buffers (scattered pages too: a gather / scatter per layer),
and a two-process domain on one GPU. Skipped where
CUDA is absent; `services/gpu-driver/run.sh` runs them on a GPU host."""

import asyncio
import uuid

import pytest
import torch

from cpcache.client import AsyncClient
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.dataplane import gather
from cpcache.dataplane.copy_faults import CopyFaults
from cpcache.dataplane.movers import DEVICE, HOST, Tiers, Transfers
from cpcache.dataplane.pools import DevicePool, HostPool
from cpcache.errors import FailedPrecondition
from cpcache.geometry import Region
from cpcache.host_layout import LAYOUTS
from cpcache.topology import Topology
from tests.gpu.cuda import (
    GEOMETRY,
    cuda_layers,
    cuda_pool,
    ipc_handle,
    layer_regions,
    pages_of,
    start_load,
    write_pages,
)

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(120),
]


def test_host_pool_is_pinned():
    assert HostPool(GEOMETRY, pages=4).tensor.is_pinned()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_host_movers_are_bit_exact(layout):
    layers = cuda_layers(32)
    device = DevicePool(GEOMETRY, layers)  # each layer its own allocation, as SGLang's
    original = [layer.clone() for layer in layers]
    host = HostPool(GEOMETRY, pages=16, layout=layout)
    transfers = Transfers(Tiers(host, device), threads=2)
    pages, slots = [3, 4, 5, 20, 31], [0, 1, 2, 9, 15]
    assert transfers.submit((DEVICE, HOST), pages, slots).result().success
    for layer in layers:
        layer.zero_()
    assert transfers.submit((HOST, DEVICE), slots, pages).result().success
    for p in pages:
        for got, want in zip(pages_of(layers, p, 1), pages_of(original, p, 1)):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bits: random bf16 holds NaNs
    untouched = [p for p in range(32) if p not in pages]
    assert all(int(view.count_nonzero()) == 0 for p in untouched for view in pages_of(layers, p, 1))
    transfers.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("by_layer", [False, True], ids=["all-layers", "layer-by-layer"])
def test_scattered_pages_are_gathered_bit_exact_into_padded_buffers(layout, by_layer):
    pages_n, pad = 32, 5
    rows = pages_n * GEOMETRY.page_size
    buffers = [torch.empty((GEOMETRY.components, rows + pad, GEOMETRY.heads, GEOMETRY.head_dim),
                           dtype=GEOMETRY.torch_dtype, device="cuda") for _ in range(GEOMETRY.layers)]
    for buffer in buffers:
        buffer.view(torch.int16).random_(-(2**15), 2**15 - 1)
    layers = [buffer[:, :rows] for buffer in buffers]  # unused rows after each layer's, as a padded pool
    device = DevicePool(GEOMETRY, layers)
    original = [buffer.clone() for buffer in buffers]
    host = HostPool(GEOMETRY, pages=16, layout=layout)
    # Past the last layer: the load goes layer by layer (as a load-back published per layer) and never fails.
    faults = CopyFaults(load_fail_layer=GEOMETRY.layers) if by_layer else CopyFaults()
    transfers = Transfers(Tiers(host, device), threads=2, copy_faults=faults)
    pages, slots = [30, 3, 17, 8, 25, 0, 12, 21, 5, 14], [9, 2, 15, 0, 7, 11, 4, 13, 1, 6]
    assert gather.gathers(GEOMETRY, len(pages), len(pages), pages)
    try:
        assert transfers.submit((DEVICE, HOST), pages, slots).result().success
        for buffer in buffers:
            buffer.zero_()
        targets = [31, 1, 19, 6, 27, 10, 2, 23, 15, 29]
        assert transfers.submit((HOST, DEVICE), slots, targets).result().success
    finally:
        transfers.close()
    torch.cuda.synchronize()
    for p, t in zip(pages, targets):
        for got, want in zip(pages_of(layers, t, 1), pages_of(original, p, 1)):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"page {p} -> {t} differs"
    untouched = [p for p in range(pages_n) if p not in targets]
    assert all(int(view.count_nonzero()) == 0 for p in untouched for view in pages_of(layers, p, 1))
    assert all(int(buffer[:, rows:].count_nonzero()) == 0 for buffer in buffers)  # nor the padding


async def round_trip(client: AsyncClient, layers: list[torch.Tensor], step: int) -> int:
    step = await write_pages(client, step, [0, 1, 2, 3])
    step = await start_load(client, step, [8, 9, 10, 11])
    await client.wait_loads([2], timeout_s=30)
    torch.cuda.synchronize()
    for loaded, written in zip(pages_of(layers, 8, 4), pages_of(layers, 0, 4)):
        assert torch.equal(loaded.view(torch.int16), written.view(torch.int16))
    return step


async def test_cuda_ipc_attach_and_round_trip(run_dir):
    layers = cuda_layers(16)
    addresses = [layer.data_ptr() for layer in layers]
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir, extra=dict(host_pool_pages=16))) as domain:
        async with AsyncClient(domain.sockets[0]) as client:
            await client.attach("gpu-test", GEOMETRY, 16, regions=layer_regions(layers))
            await round_trip(client, layers, 1)
    assert [layer.data_ptr() for layer in layers] == addresses


async def test_cuda_ipc_attach_refuses_a_gpu_the_daemon_does_not_see(run_dir):
    """Handles naming, by UUID, a GPU that is not among the daemon's (one
    hidden from it by CUDA_VISIBLE_DEVICES) are refused, and the daemon
    takes the right ones after."""
    layers = cuda_layers(16)
    regions = layer_regions(layers)
    ours = uuid.UUID(regions[0].cuda_ipc["device_uuid"])
    elsewhere = [Region(r.offset, r.strides, dict(r.cuda_ipc, device_uuid=str(uuid.UUID(int=ours.int ^ 1))))
                 for r in regions]
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir, extra=dict(host_pool_pages=16))) as domain:
        async with AsyncClient(domain.sockets[0]) as client:
            with pytest.raises(FailedPrecondition, match="not among this daemon"):
                await client.attach("gpu-test", GEOMETRY, 16, regions=elsewhere)
            await client.attach("gpu-test", GEOMETRY, 16, regions=regions)
            await round_trip(client, layers, 1)


async def test_cuda_ipc_attach_and_round_trip_of_one_contiguous_pool(run_dir):
    pool = cuda_pool(16)
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir, extra=dict(host_pool_pages=16))) as domain:
        async with AsyncClient(domain.sockets[0]) as client:
            await client.attach("gpu-test", GEOMETRY, 16, cuda_ipc=ipc_handle(pool))
            await round_trip(client, list(pool.unbind(0)), 1)


async def test_two_process_domain_on_one_gpu(run_dir):
    pools = [cuda_layers(16), cuda_layers(16)]
    async with LocalDomain(DomainSpec(Topology(tp=2), run_dir, extra=dict(host_pool_pages=16))) as domain:
        clients = [AsyncClient(s) for s in domain.sockets]
        await asyncio.gather(*(c.attach("gpu-test", GEOMETRY, 16, regions=layer_regions(p))
                               for c, p in zip(clients, pools)))
        await asyncio.gather(*(round_trip(c, p, 1) for c, p in zip(clients, pools)))
        for c in clients:
            await c.close()
