"""SGLang's device KV pool, handed to the rank's daemon where it lies.

SGLang allocates its KV per layer: MHA as one (2, rows, heads, head_dim)
tensor per layer with `k_buffer[l]` and `v_buffer[l]` its halves, MLA as one
(rows, 1, kv_dim) `kv_buffer[l]`; rows = size + page_size (page 0 absorbs
padded tokens). DeepSeek V3.2's DSA pool also keeps its indexer's keys and
scales per page and layer, an (index pages, page_size x 132) uint8
`index_k_with_scale_buffer[l]`: a part beside the KV (`KVGeometry.beside`),
one region per layer after the KV's. Each layer is one region of the daemon's device pool
([components, rows, heads, head_dim], its own strides), so nothing is moved
or copied at attach, no second copy of the pool ever exists, and CUDA graphs
captured over those buffers read what the daemon loads into them:

- on CUDA hosts, a CUDA IPC handle per layer (the caching allocator's block
  and the storage's offset in it, as `torch.multiprocessing` shares a
  storage), the region's offset within that storage;
- on hosts without CUDA, the memory must be shareable from the start:
  `shared_memory.install` makes SGLang allocate the pool inside one sealed
  memfd, handed over by descriptor, a region per layer at its offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from cpcache.cuda_devices import device_uuid
from cpcache.geometry import DTYPES, KVGeometry, PagePart, Region
from cpcache.integrations.sglang.shared_memory import SharedMemory, memory_of

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class PoolNotShareable(ValueError):
    """SGLang's KV pool cannot be handed to the daemon where it lies."""


@dataclass
class SharedPool:
    geometry: KVGeometry
    device_pages: int
    regions: list[Region]
    # Per region (`KVGeometry.planes`): (K, V) or (KV,) of each layer, then (part,)
    # of each layer for each part beside the KV: the tensors the regions describe.
    buffers: list[tuple[torch.Tensor, ...]]
    fd: int = -1  # hosts without CUDA: the memfd of SGLang's pool (it owns it), to hand over
    _memory: SharedMemory | None = field(default=None, repr=False)

    def addresses(self) -> list[tuple[int, ...]]:
        """Per layer, the address of each buffer the regions describe."""
        return [tuple(b.data_ptr() for b in layer) for layer in self.buffers]

    @property
    def cuda_device(self) -> torch.device | None:
        """The CUDA device the KV lies on (None: host memory)."""
        device = self.buffers[0][0].device
        return device if device.type == "cuda" else None


def dtype_name(dtype: torch.dtype) -> str:
    """The geometry's name of a KV dtype, or an error naming those supported."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"cpcache: SGLang KV dtype {dtype} is not supported (supported: {', '.join(DTYPES)})")
    return name


INDEXER = "indexer"  # SGLang's name of DSA's indexer part (`PoolName.INDEXER`)


def parts_beside_kv(kv_pool: Any) -> list[str]:
    """The parts of a page SGLang's pool holds beside its KV, as the pool
    itself declares them to HiCache (`host_pool_decls`): DSA's indexer keys
    and scales, and whatever a later pool adds."""
    declared = getattr(kv_pool, "host_pool_decls", None)
    if declared is None:
        return []
    names = [pool_name(getattr(decl, "pool_name", decl)) for decl in declared()]
    return [name for name in names if name != "kv"]


def pool_name(name: Any) -> str:
    """SGLang's name of a part's pool (a `PoolName`, a str enum, or a str)."""
    return str(getattr(name, "value", name))


def _indexer_part(kv_pool: Any, page_size: int) -> PagePart:
    """DSA's indexer part: per layer and page, one row of the page's index
    keys then their scales (SGLang's `index_k_with_scale_buffer`, uint8)."""
    buffers = list(kv_pool.index_k_with_scale_buffer)
    if any(skip for skip in getattr(kv_pool, "skip_topk_layers", ())) or any(b.shape[0] == 0 for b in buffers):
        raise ValueError("cpcache: this DSA pool shares top-k between layers (some layers keep no index keys), "
                         "which cpcache does not store yet: serve it without --radix-cache-backend cpcache")
    if getattr(kv_pool, "index_page_size", page_size) != page_size:
        raise ValueError(f"cpcache: DSA index pages of {kv_pool.index_page_size} tokens under KV pages of "
                         f"{page_size} (pooled or DCP-split index keys) are not supported")
    widths = {tuple(b.shape[1:]) for b in buffers}
    if len(widths) != 1 or len(next(iter(widths))) != 1:
        raise ValueError(f"cpcache: DSA indexer buffers of shapes {sorted(widths)}; one (pages, bytes) shape "
                         "for every layer is expected")
    return PagePart(INDEXER, rows_per_page=1, width=next(iter(widths))[0], dtype=dtype_name(buffers[0].dtype))


def geometry_of(kv_pool: Any, page_size: int) -> KVGeometry:
    """The daemon's geometry for an SGLang MHA, MLA or DSA token-to-KV pool:
    DSA's indexer is a part beside the KV, moved and stored with it. A pool
    with another part beside its KV is refused: a page restored without it
    would be a wrong hit (its KV with another prefix's state)."""
    extra = parts_beside_kv(kv_pool)
    unknown = [name for name in extra if name != INDEXER]
    if unknown:
        raise ValueError(f"cpcache: SGLang's {type(kv_pool).__name__} keeps {', '.join(unknown)} beside the KV of "
                         "each page, which cpcache does not store: serve this model without --radix-cache-backend "
                         "cpcache")
    if getattr(kv_pool, "is_quantized_kv_cache", False) or any(
            getattr(kv_pool, name, None) is not None for name in ("k_scale_buffer", "v_scale_buffer",
                                                                  "kv_scale_buffer")):
        raise ValueError("cpcache: quantized KV pools (with scale buffers) are not supported")
    dtype = dtype_name(kv_pool.store_dtype)
    if hasattr(kv_pool, "kv_buffer") and not hasattr(kv_pool, "k_buffer"):
        beside = (_indexer_part(kv_pool, page_size),) if INDEXER in extra else ()
        return KVGeometry(layers=kv_pool.layer_num, kv_kind="mla", heads=1, head_dim=kv_pool.kv_cache_dim,
                          dtype=dtype, page_size=page_size, beside=beside)
    if extra:
        raise ValueError(f"cpcache: an MHA pool with {', '.join(extra)} beside its KV is not supported")
    if getattr(kv_pool, "v_head_dim", kv_pool.head_dim) != kv_pool.head_dim:
        raise ValueError(f"cpcache: MHA with v_head_dim {kv_pool.v_head_dim} != head_dim {kv_pool.head_dim} "
                         "is not supported")
    if getattr(kv_pool, "kv_cache_layout", "nhd") != "nhd" or getattr(kv_pool, "use_hnd", False):
        raise ValueError("cpcache: only SGLang's token-major (NHD) KV layout is supported")
    return KVGeometry(layers=kv_pool.layer_num, kv_kind="mha", heads=kv_pool.head_num, head_dim=kv_pool.head_dim,
                      dtype=dtype, page_size=page_size)


def layer_buffers(kv_pool: Any, geometry: KVGeometry) -> list[tuple[torch.Tensor, ...]]:
    """Per region (`KVGeometry.planes`), the pool's buffers in component order:
    (K, V) or (KV,) of each layer, then (indexer,) of each layer as
    [index pages, 1, bytes]."""
    layers = range(geometry.layers)
    planes: list[tuple[torch.Tensor, ...]]
    if geometry.kv_kind == "mla":
        planes = [(kv_pool.kv_buffer[layer],) for layer in layers]
    else:
        planes = [(kv_pool.k_buffer[layer], kv_pool.v_buffer[layer]) for layer in layers]
    for part in geometry.beside:
        assert part.name == INDEXER, part.name  # geometry_of admits no other
        planes += [(kv_pool.index_k_with_scale_buffer[layer].unsqueeze(1),) for layer in layers]
    return planes


def _region(name: str, buffers: tuple[torch.Tensor, ...], geometry: KVGeometry, rows: int, base: int,
            cuda_ipc: dict[str, Any] | None = None) -> Region:
    """The region `buffers` make, at its offset from `base`: one stride
    steps from one component to the next (K to V), the rest are the
    buffers' own. A buffer may hold rows past the `rows` the pool's pages
    need (DSA keeps an index page more than KV pages)."""
    first = buffers[0]
    if any(tuple(b.shape) != tuple(first.shape) or b.stride() != first.stride() for b in buffers):
        raise PoolNotShareable(f"cpcache: {name}'s K and V buffers differ in shape or strides")
    if tuple(first.shape[1:]) != (geometry.heads, geometry.head_dim) or first.shape[0] < rows:
        raise PoolNotShareable(f"cpcache: {name}'s buffer has shape {tuple(first.shape)}, not "
                               f"{(rows, geometry.heads, geometry.head_dim)}")
    component = 0
    if len(buffers) > 1:
        step = buffers[1].data_ptr() - first.data_ptr()
        if step <= 0 or step % first.element_size():
            raise PoolNotShareable(f"cpcache: {name}'s V buffer does not follow its K buffer at a whole "
                                   "number of elements")
        component = step // first.element_size()
    return Region(first.data_ptr() - base, (component, *first.stride()), cuda_ipc)


def _rows(buffers: list[tuple[torch.Tensor, ...]], geometry: KVGeometry) -> int:
    rows = buffers[0][0].shape[0]
    if rows % geometry.page_size:
        raise PoolNotShareable(f"cpcache: {rows} KV rows are not a whole number of pages of {geometry.page_size}")
    return rows


def _planes(geometry: KVGeometry, pages: int) -> list[tuple[str, KVGeometry, int]]:
    """(name, part, rows) of each region, in region order (`KVGeometry.planes`)."""
    return [(f"{geometry.part_names[i // geometry.layers]} layer {layer}" if geometry.beside else f"layer {layer}",
             part, pages * part.page_size) for i, (part, layer) in enumerate(geometry.planes)]


def share_device_pool(kv_pool: Any, page_size: int) -> SharedPool:
    """Describe `kv_pool`'s buffers, where they lie, as the daemon's regions
    (nothing moved, nothing copied)."""
    geometry = geometry_of(kv_pool, page_size)
    buffers = layer_buffers(kv_pool, geometry)
    pages = _rows(buffers, geometry) // page_size
    planes = _planes(geometry, pages)
    device = buffers[0][0].device
    if device.type == "cuda":
        regions = []
        for (name, part, rows), plane in zip(planes, buffers):
            storage = plane[0].untyped_storage()
            if any(b.untyped_storage().data_ptr() != storage.data_ptr() for b in plane):
                raise PoolNotShareable(f"cpcache: {name}'s K and V buffers are not in one allocation "
                                       "(SGLang allocates them as halves of one tensor)")
            regions.append(_region(name, plane, part, rows, storage.data_ptr(), cuda_ipc_fields(storage)))
        return SharedPool(geometry, pages, regions, buffers)
    memory = memory_of(kv_pool)
    if memory is None:
        raise PoolNotShareable(
            "cpcache: SGLang's KV pool is not in shared memory, so the daemon cannot reach it: the cpcache "
            "plugin allocates it there when SGLang loads its `sglang.srt.plugins` entry point (install cpcache "
            "into SGLang's environment) and the server runs with --radix-cache-backend cpcache")
    regions = [_region(name, plane, part, rows, memory.address) for (name, part, rows), plane in zip(planes, buffers)]
    return SharedPool(geometry, pages, regions, buffers, fd=memory.fd, _memory=memory)


def check_in_place(pool: SharedPool, kv_pool: Any) -> None:
    """Refuse unless the buffers handed over are the ones `kv_pool` (the
    model runner's, which its forward and CUDA graphs use) holds now, layer
    by layer, and its pointer tables name them."""
    held = [tuple(b.data_ptr() for b in layer) for layer in layer_buffers(kv_pool, pool.geometry)]
    handed = pool.addresses()
    if len(held) != len(handed):
        raise PoolNotShareable(f"cpcache: the model runner holds {len(held)} KV layers, {len(handed)} were handed "
                               "to the daemon")
    for (name, _, _), h, given in zip(_planes(pool.geometry, pool.device_pages), held, handed):
        if h != given:
            raise PoolNotShareable(
                f"cpcache: the KV buffers handed to the daemon are not the ones the model runner holds ("
                f"{name}: {_hexes(given)} handed, {_hexes(h)} held); the daemon would load pages the forward "
                "never reads")
    kv = handed[: pool.geometry.layers]
    tables = {"k_data_ptrs": 0, "v_data_ptrs": 1} if pool.geometry.kv_kind == "mha" else {"data_ptrs": 0}
    for name, component in tables.items():
        table = getattr(kv_pool, name, None)
        if isinstance(table, torch.Tensor) and table.numel() >= len(kv):
            named = [int(p) for p in table[: len(kv)].tolist()]
            if named != [layer[component] for layer in kv]:
                raise PoolNotShareable(f"cpcache: SGLang's KV pointer table {name} does not name the buffers "
                                       "handed to the daemon")


def _hexes(addresses: tuple[int, ...]) -> str:
    return "/".join(f"0x{a:x}" for a in addresses)


def cuda_ipc_fields(storage: torch.UntypedStorage) -> dict[str, Any]:
    """What `torch.multiprocessing` sends for a CUDA storage (the caching
    allocator's block handle and the storage's offset in it), and the GPU's
    UUID, by which the daemon finds the GPU under its own index."""
    try:
        (device, handle, storage_size, storage_offset, ref_counter_handle, ref_counter_offset, event_handle,
         event_sync_required) = storage._share_cuda_()
    except RuntimeError as e:
        # Memory from outside torch's caching allocator (SGLang's --enable-memory-saver, a VMM allocator)
        # has no IPC handle to give.
        raise PoolNotShareable(
            f"cpcache: SGLang's KV buffers cannot be shared by CUDA IPC ({e}); they must come from torch's "
            "caching allocator, so run the server without --enable-memory-saver or a custom allocator") from e
    return dict(device=device, handle=handle, storage_size=storage_size, storage_offset=storage_offset,
                ref_counter_handle=ref_counter_handle, ref_counter_offset=ref_counter_offset,
                event_handle=event_handle, event_sync_required=event_sync_required,
                device_uuid=device_uuid(device))
