"""Where each layer of an attached device pool lies: one region per layer.

SGLang allocates its KV per layer (MHA: a [2, rows, heads, head_dim] tensor
per layer whose halves are `k_buffer[l]` and `v_buffer[l]`; MLA: a
[rows, 1, kv_dim] `kv_buffer[l]`), and its CUDA graphs are captured over
those addresses. So the daemon maps them where they are: a region is one
layer's [components, rows, heads, head_dim] view, at a byte offset into the
memory handed over (a memfd, or a CUDA storage), with any strides.

A pool with parts beside its KV (`KVGeometry.beside`) has one region per
layer for each part, after the KV's, in the order the geometry declares
them: region i is layer i % layers of part i // layers (`KVGeometry.planes`).

The checks are the daemon's protection against a caller's word: exactly one
region per layer and part, each inside its memory, aligned, no two elements
of one region at one address, and no two regions over the same bytes (a
load into one layer must never land in another).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from cpcache.errors import FailedPrecondition, InvalidArgument
from cpcache.geometry import PART_ALIGN, KVGeometry, Region

DIMS = 4  # component, row, head, head_dim


def region_shape(geometry: KVGeometry, pages: int) -> tuple[int, int, int, int]:
    return (geometry.components, pages * geometry.page_size, geometry.heads, geometry.head_dim)


def plane_name(geometry: KVGeometry, index: int) -> str:
    """How errors name region `index`: its layer, and its part if the page has several."""
    layer = index % geometry.layers
    if not geometry.beside:
        return f"region {layer}"
    return f"region {index} ({geometry.part_names[index // geometry.layers]} layer {layer})"


def part_blocks(geometry: KVGeometry, pages: int) -> list[tuple[int, int]]:
    """(offset, bytes) of each part's block in a contiguous pool of `pages`
    pages: one after another, each from a multiple of PART_ALIGN."""
    blocks, end = [], 0
    for part in geometry.parts:
        start = -(-end // PART_ALIGN) * PART_ALIGN
        end = start + part.page_bytes * pages
        blocks.append((start, end - start))
    return blocks


def pool_bytes(geometry: KVGeometry, pages: int) -> int:
    """The bytes of a contiguous pool of `pages` pages, every part (a page of KV alone: page_bytes x pages)."""
    start, size = part_blocks(geometry, pages)[-1]
    return start + size


def contiguous(geometry: KVGeometry, pages: int) -> list[Region]:
    """The regions of a contiguous pool at offset 0 (`DevicePool.create_sealed`'s):
    one [layers, components, rows, heads, head_dim] block per part (`part_blocks`)."""
    regions = []
    for part, (offset, _) in zip(geometry.parts, part_blocks(geometry, pages)):
        c, rows, h, d = region_shape(part, pages)
        strides = (rows * h * d, h * d, d, 1)
        layer_bytes = c * rows * h * d * part.element_bytes
        regions += [Region(offset + layer * layer_bytes, strides) for layer in range(part.layers)]
    return regions


def spans(geometry: KVGeometry, pages: int, region: Region) -> list[tuple[int, int]]:
    """[first byte, end) each component of the region touches (its K and its
    V apart, so layers laid out component-major do not seem to overlap)."""
    _, rows, h, d = region_shape(geometry, pages)
    last = sum((n - 1) * s for n, s in zip((rows, h, d), region.strides[1:]))
    out = []
    for component in range(geometry.components):
        first = region.offset + component * region.strides[0] * geometry.element_bytes
        out.append((first, first + (last + 1) * geometry.element_bytes))
    return out


def _check_one(geometry: KVGeometry, pages: int, name: str, region: Region, memory_bytes: int) -> None:
    shape = region_shape(geometry, pages)
    if len(region.strides) != DIMS:
        raise InvalidArgument(f"attach: {name} has {len(region.strides)} strides; a region needs {DIMS} "
                              "(component, row, head, head_dim)")
    if any(s < 0 for s in region.strides) or region.offset < 0:
        raise InvalidArgument(f"attach: {name} has a negative offset or stride")
    if region.offset % geometry.element_bytes:
        raise InvalidArgument(f"attach: {name} starts at byte {region.offset}, not a multiple of the "
                              f"{geometry.dtype} element ({geometry.element_bytes} bytes)")
    # No two elements at one address: ordered by stride, each dimension of
    # more than one element must step past everything the smaller ones span.
    reach = 0  # elements spanned by the dimensions so far, minus one
    for n, stride in sorted(((n, s) for n, s in zip(shape, region.strides) if n > 1), key=lambda x: x[1]):
        if stride <= reach:
            raise InvalidArgument(f"attach: {name}'s strides {region.strides} put two elements of its "
                                  f"{list(shape)} view at one address")
        reach += (n - 1) * stride
    end = max(e for _, e in spans(geometry, pages, region))
    if end > memory_bytes:
        raise InvalidArgument(f"attach: {name} ends at byte {end}, past the {memory_bytes} bytes of the "
                              "memory it lies in")


def check(geometry: KVGeometry, pages: int, regions: Sequence[Region],
          memory_bytes: Sequence[int], memory_of: Sequence[Hashable] | None = None,
          base_of: Sequence[int] | None = None) -> None:
    """Refuse regions the daemon must not map. `memory_bytes[l]`: the size of
    the memory region l lies in; `memory_of[l]` names the allocation it is in
    and `base_of[l]` where that memory starts in the allocation (so regions
    of different storages in one CUDA block are compared where they lie);
    by default one memory at 0 holds every region."""
    if pages < 1:
        raise InvalidArgument(f"attach: a pool needs at least 1 page, not {pages}")
    each = geometry.planes
    if len(regions) != len(each):
        parts = f" for each of its {len(geometry.parts)} parts ({', '.join(geometry.part_names)})" \
            if geometry.beside else ""
        raise InvalidArgument(f"attach: {len(regions)} regions for {geometry.layers} layers{parts}; give one "
                              "region per layer, in layer order" + (", part after part" if parts else ""))
    for index, ((part, _), region) in enumerate(zip(each, regions)):
        _check_one(part, pages, plane_name(geometry, index), region, memory_bytes[index])
    owners = memory_of if memory_of is not None else [0] * len(regions)
    bases = base_of if base_of is not None else [0] * len(regions)
    by_memory: dict[Hashable, list[tuple[int, int, int]]] = {}
    for index, ((part, _), region) in enumerate(zip(each, regions)):
        for first, end in spans(part, pages, region):
            by_memory.setdefault(owners[index], []).append((bases[index] + first, bases[index] + end, index))
    for group in by_memory.values():
        group.sort()
        reach, owner = -1, -1
        for first, end, index in group:
            if first < reach and index != owner:
                raise FailedPrecondition(f"attach: {plane_name(geometry, owner)} and {plane_name(geometry, index)} "
                                         "overlap; a load into one layer would land in another")
            if end > reach:
                reach, owner = end, index
