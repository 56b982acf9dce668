"""Device <-> host copies of scattered pages: one gather and one scatter per
layer, however many runs the pages fall in.

Copied run by run, a job costs one copy per layer per run of pages
consecutive on both sides, and the pages a load fills are those the
server's allocator hands out, consecutive only by chance: 1-token pages of
a 36-layer model become a copy per (page, layer), each paying its dispatch
(or its `cudaMemcpyAsync`). Here each layer is an `index_select` of the
pages on one side and an `index_copy_` into the other, with the page
indices built once per job (`PageIndex`), so the count of calls no longer
depends on the runs; the price is one more pass over the bytes. `gathers`
says which way a job goes.

Both sides are indexed by page on dim 1 of a [components, pages,
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
# average under SHORT_RUN_BYTES per layer; copy run by run otherwise. A run
# costs one copy per layer (about 10 us of dispatch on this project's CPU
# host, a cudaMemcpyAsync on a GPU); a gather costs two index calls per
# layer and one more pass over the bytes, which runs of a few hundred KiB
# per layer already cost less than.
MANY_RUNS = 4
SHORT_RUN_BYTES = 256 << 10

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def gathers(geometry: KVGeometry, pages: int, runs: int, destinations: Sequence[int]) -> bool:
    """Whether a job of `pages` pages in `runs` runs is copied by gather /
    scatter (`MANY_RUNS`, `SHORT_RUN_BYTES`). Never when a destination
    repeats: run by run the last copy wins, an index_copy_ leaves it open."""
    if runs <= MANY_RUNS or pages * geometry.page_bytes >= SHORT_RUN_BYTES * runs * geometry.layers:
        return False
    return len(set(destinations)) == len(destinations)


@dataclass(frozen=True)
class PageIndex:
    """A job's pages as index tensors, built once per job: host slots on the
    CPU, device pages where the device pool is."""

    host: torch.Tensor
    device: torch.Tensor

    @staticmethod
    def of(device: DevicePool, host_pages: Sequence[int], device_pages: Sequence[int]) -> PageIndex:
        pages = torch.tensor(device_pages, dtype=torch.long)
        if device.is_cuda:  # from pinned memory: a pageable copy would wait for the stream
            pages = pages.pin_memory().to(device.layers[0].device, non_blocking=True)
        return PageIndex(torch.tensor(host_pages, dtype=torch.long), pages)


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
        on_device.index_copy_(1, index.device, on_host.index_select(1, index.host))
        return
    shape = (on_host.shape[0], len(index.host), *on_host.shape[2:])
    staged = torch.empty(shape, dtype=on_host.dtype, pin_memory=True)
    torch.index_select(on_host, 1, index.host, out=staged)
    # The pinned block is reused only once this copy has run (torch's
    # caching host allocator records the stream), so it may be dropped now.
    on_device.index_copy_(1, index.device, staged.to(on_device.device, non_blocking=True))


def store(device: DevicePool, host: HostPool, index: PageIndex) -> None:
    """Every layer of the job's pages from the device pool into their host
    slots (on a CUDA device: waits once for the job's copies)."""
    layers = range(device.geometry.layers)
    if not device.is_cuda:
        for layer in layers:
            on_device, on_host = _layer(device, host, layer)
            on_host.index_copy_(1, index.host, on_device.index_select(1, index.device))
        return
    staged = []
    for layer in layers:
        on_device, on_host = _layer(device, host, layer)
        gathered = on_device.index_select(1, index.device)
        pinned = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        staged.append((on_host, pinned.copy_(gathered, non_blocking=True)))
    device.synchronize()
    for on_host, pinned in staged:
        on_host.index_copy_(1, index.host, pinned)
