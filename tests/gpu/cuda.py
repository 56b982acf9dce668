"""What the GPU tests share: a CUDA pool of one geometry, its IPC handle as
the Attach message carries it, and a write then load of pages through a daemon."""

import torch

from cpcache.client import AsyncClient, CacheRequests
from cpcache.geometry import KVGeometry

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


PAGE_KEYS = [bytes([i]) * 32 for i in range(4)]


async def write_pages(client: AsyncClient, step: int, device_pages: list[int], op_id: int = 1) -> int:
    """Write `device_pages` to the host tier under PAGE_KEYS; -> the next step."""
    await client.step(step, requests=CacheRequests(writes=((op_id, PAGE_KEYS, device_pages),)))
    while op_id not in (await client.step(step + 1)).write_acks:
        step += 1
    return step + 2


async def start_load(client: AsyncClient, step: int, device_pages: list[int], op_id: int = 2) -> int:
    """Open a load of PAGE_KEYS into `device_pages` (wait for it with
    `client.wait_loads([op_id])`); -> the next step."""
    await client.step(step, requests=CacheRequests(loads=((op_id, PAGE_KEYS, device_pages),)))
    return step + 1
