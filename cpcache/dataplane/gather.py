"""Device <-> host copies of scattered pages: one gather and one scatter per
layer, however many runs the pages fall in.

Copied run by run, a job costs one copy per layer per run of pages
consecutive on both sides, and the pages a load fills are those the
server's allocator hands out, consecutive only by chance: 1-token pages of
a 36-layer model become a copy per (page, layer), each paying its dispatch
(or its `cudaMemcpyAsync`). Here each layer is an `index_select` of the
pages on one side and an `index_copy_` into the other, with the page
indices built once per job (`PageIndex`), so the count of calls no longer
depends on the runs; the price, where neither side's pages are consecutive,
is one more pass over the bytes. `gathers` says which way a job goes.

Both sides are indexed by page on dim 0 of a [pages, components,
page_size, heads, head_dim] view of one layer (`DevicePool.paged_layer`,
`HostPool.paged_layer`), whatever the strides: an `index_copy_` writes
the indexed pages and nothing else (not the padding between a region's
rows, not another layer). Elements are moved as integers of the widest
size both views allow: bits, not values (NaN payloads, fp8), and fewer
elements for the index kernels.

On a CUDA device the device side runs there and the host side on the CPU
through pinned staging (an index kernel cannot reach the host pool):
loads gather a layer's slots into pinned memory and queue its copy and
scatter, with no wait; stores queue every layer's gather and copy, wait
once for the job, then scatter into the host pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cpcache.dataplane.pools import DevicePool, HostPool
from cpcache.geometry import KVGeometry

# The rule: gather when the job has more than MANY_RUNS runs and its runs
# average at most SHORT_RUN_BYTES per layer; copy run by run otherwise. A run
# costs one copy per layer (about 10 us of dispatch on this project's CPU
# host, a cudaMemcpyAsync on a GPU); a gather costs two index calls per
# layer and, where neither side's pages are consecutive, one more pass over
# the bytes. Measured on a CPU host (scripts/bench_layer_copies.py and a
# sweep of page sizes, both sides shuffled or the host side in order):
# gathers take 1/11 to 1/1.3 of the time run by run on runs of 4 to 64 KiB
# per layer, about as long near 128 KiB, and up to 1.4x as long (two
# passes) on runs of 256 KiB and more.
MANY_RUNS = 4
SHORT_RUN_BYTES = 128 << 10

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def gathers(geometry: KVGeometry, pages: int, runs: int, destinations: Sequence[int]) -> bool:
    """Whether a job of `pages` pages in `runs` runs is copied by gather /
    scatter (`MANY_RUNS`, `SHORT_RUN_BYTES`). Never when a destination
    repeats: run by run the last copy wins, an index_copy_ leaves it open."""
    if runs <= MANY_RUNS or pages * geometry.page_bytes > SHORT_RUN_BYTES * runs * geometry.layers:
        return False
    return len(set(destinations)) == len(destinations)


@dataclass(frozen=True)
class PageIndex:
    """A job's pages as index tensors, built once per job: host slots on the
    CPU, device pages where the device pool is; and where one side's pages
    are consecutive, the first (a CPU device then reads or writes that side
    as a view, in the same pass as the other side's index)."""

    host: torch.Tensor
    device: torch.Tensor
    host_first: int | None = None
    device_first: int | None = None

    @staticmethod
    def of(device: DevicePool, host_pages: Sequence[int], device_pages: Sequence[int]) -> PageIndex:
        pages = torch.tensor(device_pages, dtype=torch.long)
        if device.is_cuda:  # from pinned memory: a pageable copy would wait for the stream
            pages = pages.pin_memory().to(device.layers[0].device, non_blocking=True)
        return PageIndex(torch.tensor(host_pages, dtype=torch.long), pages, _first(host_pages), _first(device_pages))


def _first(pages: Sequence[int]) -> int | None:
    """The first page where the pages are consecutive, else None."""
    return pages[0] if list(pages) == list(range(pages[0], pages[0] + len(pages))) else None


def _copy(dst: torch.Tensor, dst_index: torch.Tensor, dst_first: int | None,
          src: torch.Tensor, src_index: torch.Tensor, src_first: int | None) -> None:
    """dst[pages] = src[pages] on the CPU, in one pass where a side is a
    run of consecutive pages, in two (gather, then scatter) otherwise."""
    count = len(dst_index)
    if dst_first is not None and src_first is not None:
        dst.narrow(0, dst_first, count).copy_(src.narrow(0, src_first, count))
    elif dst_first is not None:
        torch.index_select(src, 0, src_index, out=dst.narrow(0, dst_first, count))
    else:
        source = src.narrow(0, src_first, count) if src_first is not None else src.index_select(0, src_index)
        dst.index_copy_(0, dst_index, source)


def _as_words(device_layer: torch.Tensor, host_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both views as integers of the widest size both allow (same shape but
    the last dimension), aligned to it."""
    size = device_layer.element_size()
    for width in (8, 4, 2, 1):
        if width < size or width % size:
            continue
        try:
            pair = device_layer.view(_WORDS[width]), host_layer.view(_WORDS[width])
        except RuntimeError:  # a stride or an offset that is not a multiple of the width
            continue
        if all(t.data_ptr() % width == 0 for t in pair):
            return pair
    raise AssertionError(f"no integer view of {size}-byte elements")  # the element's own size always fits


def _layer(device: DevicePool, host: HostPool, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _as_words(device.paged_layer(layer), host.paged_layer(layer))


def load_layer(device: DevicePool, host: HostPool, index: PageIndex, layer: int) -> None:
    """One layer of the job's pages from their host slots into the device
    pool (on a CUDA device queued on the current stream, not waited for)."""
    on_device, on_host = _layer(device, host, layer)
    if not device.is_cuda:
        _copy(on_device, index.device, index.device_first, on_host, index.host, index.host_first)
        return
    staged = torch.empty((len(index.host), *on_host.shape[1:]), dtype=on_host.dtype, pin_memory=True)
    torch.index_select(on_host, 0, index.host, out=staged)
    # The pinned block is reused only once this copy has run (torch's
    # caching host allocator records the stream), so it may be dropped now.
    on_device.index_copy_(0, index.device, staged.to(on_device.device, non_blocking=True))


def store(device: DevicePool, host: HostPool, index: PageIndex) -> None:
    """Every layer of the job's pages from the device pool into their host
    slots (on a CUDA device: waits once for the job's copies)."""
    layers = range(device.geometry.layers)
    if not device.is_cuda:
        for layer in layers:
            on_device, on_host = _layer(device, host, layer)
            _copy(on_host, index.host, index.host_first, on_device, index.device, index.device_first)
        return
    staged = []
    for layer in layers:
        on_device, on_host = _layer(device, host, layer)
        gathered = on_device.index_select(0, index.device)
        pinned = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        staged.append((on_host, pinned.copy_(gathered, non_blocking=True)))
    device.synchronize()
    for on_host, pinned in staged:
        on_host.index_copy_(0, index.host, pinned)
