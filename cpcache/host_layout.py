"""Where a host page lies in a host pool of each layout: the one copy of
that arithmetic, read by the daemon that owns the pool and by a scheduler
that maps it to finish a load its dead daemon left half copied.

The layouts are SGLang's host layouts, byte for byte (pool_host/mha.py,
pool_host/mla.py), with the K/V component outermost (MLA has one):
  layer_first        [components, layers, tokens, heads, head_dim]
  page_first         [components, tokens, layers, heads, head_dim]
  page_first_direct  [components, pages, layers, page_size, heads, head_dim]

A page with parts beside its KV keeps each part as a pool of its own in the
same layout (a part's "page" is its rows_per_page rows), the parts one after
another in one memory (`part_tensors`).
"""

from __future__ import annotations

import torch

from cpcache.errors import InvalidArgument
from cpcache.geometry import PART_ALIGN, KVGeometry

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def host_shape(geometry: KVGeometry, pages: int, layout: str) -> tuple[int, ...]:
    if layout not in LAYOUTS:
        raise InvalidArgument(f"host pool: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    g = geometry
    c, tokens = g.components, pages * g.page_size
    return {
        "layer_first": (c, g.layers, tokens, g.heads, g.head_dim),
        "page_first": (c, tokens, g.layers, g.heads, g.head_dim),
        "page_first_direct": (c, pages, g.layers, g.page_size, g.heads, g.head_dim),
    }[layout]


def part_offsets(geometry: KVGeometry, pages: int, layout: str) -> list[int]:
    """Where each part's pool starts in the host pool's memory (aligned to
    PART_ALIGN), and where the last ends."""
    offsets, end = [], 0
    for part in geometry.parts:
        offsets.append(-(-end // PART_ALIGN) * PART_ALIGN)
        end = offsets[-1] + int(torch.Size(host_shape(part, pages, layout)).numel()) * part.element_bytes
    return [*offsets, end]


def host_bytes(geometry: KVGeometry, pages: int, layout: str) -> int:
    """The bytes of a host pool of `pages` pages, every part."""
    return part_offsets(geometry, pages, layout)[-1]


def part_tensors(memory: torch.Tensor, geometry: KVGeometry, pages: int, layout: str) -> list[torch.Tensor]:
    """Each part's pool (`host_shape`), a view of `memory` (bytes, of at least `host_bytes`)."""
    offsets = part_offsets(geometry, pages, layout)
    out = []
    for part, start in zip(geometry.parts, offsets):
        shape = host_shape(part, pages, layout)
        size = int(torch.Size(shape).numel()) * part.element_bytes
        out.append(memory[start : start + size].view(part.torch_dtype).view(shape))
    return out


def page_view(tensor: torch.Tensor, geometry: KVGeometry, layout: str, first: int, count: int = 1) -> torch.Tensor:
    """Pages [first, first+count) as a [layers, components, pages, page_size,
    heads, head_dim] view (never a copy: copies into it land in the pool)."""
    s = geometry.page_size
    if layout == "layer_first":  # [C, L, n*s, H, D]
        return tensor[:, :, first * s : (first + count) * s].unflatten(2, (count, s)).permute(1, 0, 2, 3, 4, 5)
    if layout == "page_first":  # [C, n*s, L, H, D]
        return tensor[:, first * s : (first + count) * s].unflatten(1, (count, s)).permute(3, 0, 1, 2, 4, 5)
    return tensor[:, first : first + count].permute(2, 0, 1, 3, 4, 5)  # [C, n, L, s, H, D]


def stored_page(tensor: torch.Tensor, geometry: KVGeometry, layout: str, slot: int) -> torch.Tensor:
    """One page in stored order, [components, layers, page_size, heads,
    head_dim] (a view): the order of a page in storage, whatever the layout."""
    return page_view(tensor, geometry, layout, slot)[:, :, 0].transpose(0, 1)


def paged_layer(tensor: torch.Tensor, geometry: KVGeometry, layout: str, pages: int, layer: int) -> torch.Tensor:
    """One layer as a [pages, components, page_size, heads, head_dim] view,
    indexed by slot on dim 0 (gathers of scattered pages)."""
    if layout == "layer_first":  # [C, L, P*s, H, D]
        by_component = tensor[:, layer].unflatten(1, (pages, geometry.page_size))
    elif layout == "page_first":  # [C, P*s, L, H, D]
        by_component = tensor[:, :, layer].unflatten(1, (pages, geometry.page_size))
    else:  # [C, P, L, s, H, D]
        by_component = tensor[:, :, layer]
    return by_component.transpose(0, 1)
