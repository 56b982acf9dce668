"""SGLang's own HiCache (host memory tier, and its storage tier) on this CPU-only host,
for a side-by-side comparison with cpcache. Imported by sitecustomize.py only
when CPCACHE_TEST_HICACHE_CPU=1; for comparisons on such hosts only (the SGLang
suite, `cpcache bench sglang`).

Supported: `--hicache-io-backend direct` with `--hicache-mem-layout
layer_first` (hicache.HICACHE_FLAGS) or `page_first_direct` (what SGLang's
Mooncake backend needs for an MHA model: hicache.hicache_mooncake_flags).
Here "device" memory is host memory too, so a transfer is a plain torch
copy, done synchronously on the calling thread; the torch.cpu Stream and
Event stand-ins SGLang already picks on CPU (record and wait do nothing,
query is True) are then exact.

The modules are patched as they are imported (import_patches.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch


def _patch_host_pool_common(module: ModuleType) -> None:
    # pool_host.common.alloc_with_host_register pins a host pool by calling
    # _cuda_host_register (cudaHostRegister through torch.cuda.cudart()): on
    # a torch without CUDA that raises "Torch not compiled with CUDA enabled".
    # Nothing to pin on a CPU host: the pool stays ordinary memory.
    def no_host_register(buffer: torch.Tensor, registration_granularity_bytes: int | None = None) -> None:
        return None

    setattr(module, "_cuda_host_register", no_host_register)  # noqa: B010


def _patch_host_pool_base(module: ModuleType) -> None:
    # HostKVCache keeps its pin_memory flag (True by default) and later
    # allocates with it: every storage read of a page allocates a pinned
    # bounce page (pool_host/mha.py get_dummy_flat_data_page), which raises
    # on a torch without CUDA; cache_controller._page_transfer then logs
    # "HiCache prefetch transfer failed" and counts 0 pages, so HiCache would
    # write its storage tier and never read it back. Nothing can be pinned
    # on a CPU host: every host pool is built unpinned.
    cls = module.HostKVCache
    init = cls.__init__

    @functools.wraps(init)
    def unpinned(self: object, *args: object, **kwargs: object) -> None:
        kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    cls.__init__ = unpinned


def transfer_kv_direct(src_layers: list[torch.Tensor], dst_layers: list[torch.Tensor],
                       src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    """sgl_kernel.kvcacheio.transfer_kv_direct in plain torch: for every layer
    pair, dst[dst_indices[i]] = src[src_indices[i]] (token rows; the kernel
    copies runs of `page_size` contiguous rows, same result)."""
    assert len(src_layers) == len(dst_layers), (len(src_layers), len(dst_layers))
    assert src_indices.numel() == dst_indices.numel(), (src_indices.numel(), dst_indices.numel())
    src_indices = src_indices.to(torch.int64)
    dst_indices = dst_indices.to(torch.int64)
    for src, dst in zip(src_layers, dst_layers):
        dst.index_copy_(0, dst_indices.to(dst.device), src.index_select(0, src_indices.to(src.device)).to(dst.device))


def _page_rows(host: torch.Tensor, device: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, row in the page) of each token index of a page_first_direct
    host pool. The kernels copy whole pages, from each page's first index:
    anything else is refused here as the kernels refuse it (or would copy
    other rows than named), so a CPU run cannot pass where a GPU's fails."""
    assert host.numel() == device.numel(), (host.numel(), device.numel())
    assert host.numel() % page_size == 0, (host.numel(), page_size)
    host = host.to(torch.int64)
    pages = host.view(-1, page_size)
    steps = torch.arange(page_size, dtype=torch.int64)
    assert bool(((pages[:, 0] % page_size) == 0).all()), "host indices must start each page at a page boundary"
    assert bool((pages == pages[:, :1] + steps).all()), "host indices must run through each page"
    runs = device.to(torch.int64).view(-1, page_size)
    assert bool((runs == runs[:, :1] + steps).all()), "device indices must run through each page"
    return torch.div(host, page_size, rounding_mode="floor"), host % page_size


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: list[torch.Tensor], dst_ptrs: list[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor,
                                       page_size: int) -> None:
    """sgl_kernel.kvcacheio's kernel of that name in plain torch: every layer
    of a layer-first device pool (`src_ptrs`: K layers, then V layers) into a
    page_first_direct host pool (`dst_ptrs`: K, then V, each [page, layer,
    row in page, head, dim])."""
    layers = len(src_ptrs) // len(dst_ptrs)
    pages, rows = _page_rows(dst_indices, src_indices, page_size)
    src_indices = src_indices.to(torch.int64)
    for part, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            src = src_ptrs[part * layers + layer]
            dst[pages, layer, rows] = src.index_select(0, src_indices.to(src.device)).to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: list[torch.Tensor], dst_ptrs: list[torch.Tensor],
                                       src_indices: torch.Tensor, dst_indices: torch.Tensor, layer_id: int,
                                       page_size: int) -> None:
    """The reverse for one layer: a page_first_direct host pool's rows
    (`src_ptrs`: K, V) into that layer of a layer-first device pool."""
    pages, rows = _page_rows(src_indices, dst_indices, page_size)
    dst_indices = dst_indices.to(torch.int64)
    for src, dst in zip(src_ptrs, dst_ptrs):
        dst.index_copy_(0, dst_indices.to(dst.device), src[pages, layer_id, rows].to(dst.device))


def _patch_host_pool_mha(module: ModuleType) -> None:
    # pool_host.mha imports its transfer ops from sgl_kernel.kvcacheio only
    # when is_cuda() or is_hip(): on CPU `transfer_kv_direct` is not bound at
    # all, and MHATokenToKVPoolHost.load_to_device_per_layer and
    # backup_from_device_all_layer (io_backend "direct", layouts
    # "layer_first" and "page_first_direct") would raise NameError. Bind the
    # plain-torch copies.
    setattr(module, "transfer_kv_direct", transfer_kv_direct)  # noqa: B010
    setattr(module, "transfer_kv_all_layer_direct_lf_pf", transfer_kv_all_layer_direct_lf_pf)  # noqa: B010
    setattr(module, "transfer_kv_per_layer_direct_pf_lf", transfer_kv_per_layer_direct_pf_lf)  # noqa: B010


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "sglang.srt.mem_cache.pool_host.base": _patch_host_pool_base,
    "sglang.srt.mem_cache.pool_host.common": _patch_host_pool_common,
    "sglang.srt.mem_cache.pool_host.mha": _patch_host_pool_mha,
}
