"""What the GPU tests share: KV buffers of one geometry laid out as SGLang
allocates them (a [2, rows, heads, head_dim] CUDA tensor per layer, K and V
its halves), the per-layer regions the Attach message carries for them (an
IPC handle per layer), and a write then load of pages through a daemon."""

import torch

from cpcache.client import AsyncClient, CacheRequests, LoadRequest, WriteRequest
from cpcache.geometry import KVGeometry, Region
from cpcache.integrations.sglang.pool import cuda_ipc_fields

GEOMETRY = KVGeometry(layers=4, kv_kind="mha", heads=8, head_dim=128, dtype="bfloat16", page_size=16)


def cuda_layers(pages: int, random: bool = True) -> list[torch.Tensor]:
    """One [components, rows, heads, head_dim] CUDA tensor per layer, each
    its own allocation (as SGLang's `_create_buffers_normal`)."""
    shape = (GEOMETRY.components, pages * GEOMETRY.page_size, GEOMETRY.heads, GEOMETRY.head_dim)
    layers = []
    for _ in range(GEOMETRY.layers):
        layer = torch.empty(shape, dtype=GEOMETRY.torch_dtype, device="cuda")
        if random:
            layer.view(torch.int16).random_(-(2**15), 2**15 - 1)
        layers.append(layer)
    return layers


def layer_regions(layers: list[torch.Tensor]) -> list[Region]:
    """A region per layer, each with the IPC handle of its own storage (what
    the SGLang backend sends: `pool.share_device_pool`)."""
    regions = []
    for layer in layers:
        storage = layer.untyped_storage()
        regions.append(Region(layer.data_ptr() - storage.data_ptr(), tuple(layer.stride()), cuda_ipc_fields(storage)))
    return regions


def cuda_pool(pages: int) -> torch.Tensor:
    """One contiguous [layers, components, rows, heads, head_dim] pool (a
    scheduler of its own sharing one storage)."""
    pool = torch.empty(GEOMETRY.pool_shape(pages), dtype=GEOMETRY.torch_dtype, device="cuda")
    pool.view(torch.int16).random_(-(2**15), 2**15 - 1)
    return pool


def ipc_handle(tensor: torch.Tensor) -> dict:
    """The fields of `_share_cuda_()` for the tensor's whole storage, as the Attach message carries them."""
    return cuda_ipc_fields(tensor.untyped_storage())


def pages_of(layers: list[torch.Tensor], first: int, count: int) -> list[torch.Tensor]:
    """Pages [first, first+count) of every layer, K and V."""
    s = GEOMETRY.page_size
    return [layer[:, first * s:(first + count) * s] for layer in layers]


PAGE_KEYS = [bytes([i]) * 32 for i in range(4)]


async def write_pages(client: AsyncClient, step: int, device_pages: list[int], op_id: int = 1) -> int:
    """Write `device_pages` to the host tier under PAGE_KEYS; -> the next step."""
    await client.step(step, requests=CacheRequests(writes=(WriteRequest(op_id, PAGE_KEYS, device_pages),)))
    while op_id not in (await client.step(step + 1)).write_acks:
        step += 1
    return step + 2


async def start_load(client: AsyncClient, step: int, device_pages: list[int], op_id: int = 2) -> int:
    """Open a load of PAGE_KEYS into `device_pages` (wait for it with
    `client.wait_loads([op_id])`); -> the next step."""
    await client.step(step, requests=CacheRequests(loads=(LoadRequest(op_id, PAGE_KEYS, device_pages),)))
    return step + 1
