"""SGLang's device KV pool, placed where the rank's daemon can reach it.

SGLang allocates its KV per layer: MHA as one (2, rows, heads, head_dim)
tensor per layer with `k_buffer[l]` and `v_buffer[l]` its halves, MLA as one
(rows, 1, kv_dim) `kv_buffer[l]`; rows = size + page_size (page 0 absorbs
padded tokens). Stacked over layers this is exactly the daemon's device pool,
[layers, components, tokens, heads, head_dim]. So the pool is moved once, at
start, into one allocation the daemon maps (on hosts without CUDA a memfd
sealed against shrinking, handed to the daemon by descriptor; elsewhere one
CUDA allocation shared by IPC handle), and every per-layer buffer becomes a
view of it: no copy on any step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from cpcache.geometry import DTYPES, KVGeometry

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass
class SharedPool:
    geometry: KVGeometry
    device_pages: int
    tensor: torch.Tensor  # [layers, components, rows, heads, head_dim]
    fd: int = -1  # hosts without CUDA: the sealed memfd to hand over
    cuda_ipc: dict[str, Any] | None = None  # CUDA hosts
    _mapping: Any = None  # keeps a shared-memory mapping alive

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def geometry_of(kv_pool: Any, page_size: int) -> KVGeometry:
    """The daemon's geometry for an SGLang MHA or MLA token-to-KV pool."""
    if getattr(kv_pool, "is_quantized_kv_cache", False) or any(
            getattr(kv_pool, name, None) is not None for name in ("k_scale_buffer", "v_scale_buffer",
                                                                  "kv_scale_buffer")):
        raise ValueError("cpcache: quantized KV pools (with scale buffers) are not supported")
    dtype = _DTYPE_NAMES.get(kv_pool.store_dtype)
    if dtype is None:
        raise ValueError(f"cpcache: SGLang KV dtype {kv_pool.store_dtype} is not supported "
                         f"(supported: {', '.join(DTYPES)})")
    if hasattr(kv_pool, "kv_buffer") and not hasattr(kv_pool, "k_buffer"):
        return KVGeometry(layers=kv_pool.layer_num, kv_kind="mla", heads=1, head_dim=kv_pool.kv_cache_dim,
                          dtype=dtype, page_size=page_size)
    if getattr(kv_pool, "v_head_dim", kv_pool.head_dim) != kv_pool.head_dim:
        raise ValueError(f"cpcache: MHA with v_head_dim {kv_pool.v_head_dim} != head_dim {kv_pool.head_dim} "
                         "is not supported")
    if getattr(kv_pool, "kv_cache_layout", "nhd") != "nhd" or getattr(kv_pool, "use_hnd", False):
        raise ValueError("cpcache: only SGLang's token-major (NHD) KV layout is supported")
    return KVGeometry(layers=kv_pool.layer_num, kv_kind="mha", heads=kv_pool.head_num, head_dim=kv_pool.head_dim,
                      dtype=dtype, page_size=page_size)


def _rows(kv_pool: Any, geometry: KVGeometry) -> int:
    first = kv_pool.kv_buffer[0] if geometry.kv_kind == "mla" else kv_pool.k_buffer[0]
    rows = first.shape[0]
    if rows % geometry.page_size:
        raise ValueError(f"cpcache: {rows} KV rows are not a whole number of pages of {geometry.page_size}")
    return rows


def _allocate_sealed(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Any, int]:
    """A memfd sealed against shrinking and growing (the daemon refuses a
    pool that could shrink under it), mapped here."""
    import fcntl
    import mmap

    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    fd = os.memfd_create("cpcache-sglang-kv", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    mapping = mmap.mmap(fd, nbytes)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(shape), mapping, fd


def share_device_pool(kv_pool: Any, page_size: int) -> SharedPool:
    """Move `kv_pool`'s buffers into one shared allocation, in place: the pool's
    per-layer buffers become views of it, their contents kept."""
    geometry = geometry_of(kv_pool, page_size)
    rows = _rows(kv_pool, geometry)
    shape = (geometry.layers, geometry.components, rows, geometry.heads, geometry.head_dim)
    device = (kv_pool.kv_buffer[0] if geometry.kv_kind == "mla" else kv_pool.k_buffer[0]).device
    mapping, fd = None, -1
    if device.type == "cuda":
        tensor = torch.empty(shape, dtype=geometry.torch_dtype, device=device)
    else:
        tensor, mapping, fd = _allocate_sealed(shape, geometry.torch_dtype)
    if geometry.kv_kind == "mla":
        for layer in range(geometry.layers):
            tensor[layer, 0].copy_(kv_pool.kv_buffer[layer])
        kv_pool.kv_buffer = [tensor[layer, 0] for layer in range(geometry.layers)]
        if hasattr(kv_pool, "data_ptrs"):  # MLA's pointer table names the new buffers too
            kv_pool.data_ptrs = torch.tensor([b.data_ptr() for b in kv_pool.kv_buffer], dtype=torch.uint64,
                                             device=device)
    else:
        for layer in range(geometry.layers):
            tensor[layer, 0].copy_(kv_pool.k_buffer[layer])
            tensor[layer, 1].copy_(kv_pool.v_buffer[layer])
        kv_pool.k_buffer = [tensor[layer, 0] for layer in range(geometry.layers)]
        kv_pool.v_buffer = [tensor[layer, 1] for layer in range(geometry.layers)]
        # The pool's pointer tables must name the new buffers.
        if hasattr(kv_pool, "_build_kv_buffer_descs"):
            kv_pool._kv_buffer_descs = kv_pool._build_kv_buffer_descs()
        if hasattr(kv_pool, "_init_data_ptrs_and_strides"):
            kv_pool._init_data_ptrs_and_strides()
    pool = SharedPool(geometry, rows // page_size, tensor, fd=fd, _mapping=mapping)
    if device.type == "cuda":
        pool.cuda_ipc = _cuda_ipc_fields(tensor)
    return pool


def _cuda_ipc_fields(tensor: torch.Tensor) -> dict[str, Any]:
    (device, handle, storage_size, storage_offset, ref_counter_handle, ref_counter_offset, event_handle,
     event_sync_required) = tensor.untyped_storage()._share_cuda_()
    return dict(device=device, handle=handle, storage_size=storage_size, storage_offset=storage_offset,
                ref_counter_handle=ref_counter_handle, ref_counter_offset=ref_counter_offset,
                event_handle=event_handle, event_sync_required=event_sync_required)
