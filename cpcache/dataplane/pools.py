"""The two memory tiers a daemon touches: the device pool (owned by the
inference process, attached once) and the host pool (owned by the daemon).

Both are torch tensors. A page is addressed by an index. The device pool is
a view per layer (`regions`: SGLang's buffers where they lie) and
`DevicePool.layer_pages` gives one layer's run of pages; the host pool's
`page_view` gives a [layers, components, pages, page_size, heads, head_dim]
view of a run, so a copy between tiers is one `copy_` per layer per run of
consecutive pages, whatever the layouts.

A page with parts beside its KV (`KVGeometry.beside`: DeepSeek V3.2's
indexer keys) has a pool per part on each tier, `parts`: the movers copy
each part as they copy the KV, and storage reads and writes the page as the
parts' bytes one after another (`HostPool.page_parts`), under one checksum.
"""

from __future__ import annotations

import fcntl
import functools
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cpcache import host_layout
from cpcache.cuda_devices import on_local_devices
from cpcache.dataplane.host_memory import pin_in_place, shared_zeros
from cpcache.dataplane.memfd import check_pool
from cpcache.dataplane.regions import check as check_regions
from cpcache.dataplane.regions import contiguous, pool_bytes, region_shape
from cpcache.errors import FailedPrecondition, InvalidArgument
from cpcache.geometry import KVGeometry, Region
from cpcache.load_signals import LoadSignals


@dataclass
class DevicePool:
    """The inference process's KV pool, where it lies: one [components, rows,
    heads, head_dim] view per layer (`regions.Region`), any strides, in one
    memory or many (SGLang's per-layer buffers). Nothing is copied to make
    it: the views are of the memory the creator writes."""

    geometry: KVGeometry
    layers: list[torch.Tensor]
    _keepalive: object = None  # the mappings or storages behind the views
    fd: int = -1  # the creator's descriptor of a memfd pool, to hand over
    identity: tuple = ()  # which memory this is (device and inode of a memfd, regions), to tell a retry
    signals: LoadSignals | None = None  # where load-backs publish their layers (the overlapped load-back)
    beside: list[DevicePool] = field(default_factory=list)  # a pool per part beside the KV (`geometry.beside`)

    def __post_init__(self) -> None:
        if len(self.beside) != len(self.geometry.beside):  # a part never moved would be stored as zeros
            raise InvalidArgument(f"device pool: {len(self.beside)} pools beside the KV for the geometry's "
                                  f"{len(self.geometry.beside)} parts")

    @functools.cached_property
    def parts(self) -> list[DevicePool]:
        """A pool per part of the page, each of its own geometry: the KV
        (these layers), then each part beside it. [self] for a page of KV alone."""
        if not self.beside:
            return [self]
        return [DevicePool(self.geometry.parts[0], self.layers), *self.beside]

    @property
    def pages(self) -> int:
        return self.layers[0].shape[1] // self.geometry.page_size

    @property
    def is_cuda(self) -> bool:
        return self.layers[0].is_cuda

    def layer_pages(self, layer: int, first: int, count: int = 1) -> torch.Tensor:
        """Pages [first, first+count) of one layer as a [components, pages,
        page_size, heads, head_dim] view."""
        s = self.geometry.page_size
        return self.layers[layer][:, first * s : (first + count) * s].unflatten(1, (count, s))

    def paged_layer(self, layer: int) -> torch.Tensor:
        """One layer as a [pages, components, page_size, heads, head_dim]
        view, indexed by page on dim 0 (gathers of scattered pages)."""
        return self.layers[layer].unflatten(1, (self.pages, self.geometry.page_size)).transpose(0, 1)

    def synchronize(self) -> None:
        """Wait for the copies queued on this pool's device (none on a CPU)."""
        if self.is_cuda:
            torch.cuda.current_stream(self.layers[0].device).synchronize()

    @property
    def tensor(self) -> torch.Tensor:
        """The KV as one [layers, components, rows, heads, head_dim] view (a
        part beside it: `parts[i].tensor`), where its layers lie at one stride in one memory (a pool made
        by `create_sealed`, SGLang's pool on a host without CUDA); for
        creators and tests: movers go layer by layer."""
        first = self.layers[0]
        if len(self.layers) == 1:
            return first.unsqueeze(0)
        step = self.layers[1].data_ptr() - first.data_ptr()
        regular = step > 0 and step % first.element_size() == 0 and all(
            layer.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and layer.stride() == first.stride() and layer.data_ptr() - first.data_ptr() == i * step
            for i, layer in enumerate(self.layers))
        if not regular:
            raise FailedPrecondition("device pool: its layers do not lie at one stride in one memory")
        return first.as_strided((len(self.layers), *first.shape), (step // first.element_size(), *first.stride()),
                                first.storage_offset())

    def page_view(self, first: int, count: int = 1) -> torch.Tensor:
        """Pages [first, first+count) of the KV of a pool at one stride
        (`tensor`) as a [layers, components, pages, page_size, heads, head_dim] view."""
        s = self.geometry.page_size
        return self.tensor[:, :, first * s : (first + count) * s].unflatten(2, (count, s))

    @staticmethod
    def of_tensor(geometry: KVGeometry, tensor: torch.Tensor) -> DevicePool:
        """A pool this process holds as one [layers, components, rows, heads,
        head_dim] tensor (tools and tests driving the movers alone)."""
        return DevicePool(geometry, list(tensor.unbind(0)))

    @staticmethod
    def from_fd(fd: int, geometry: KVGeometry, pages: int, regions: Sequence[Region] = ()) -> DevicePool:
        """Map a pool handed over by descriptor (hosts without CUDA): a shmem
        memfd, open for writing, sealed against shrinking and growing
        (`memfd.check_pool`), its layers at `regions` (none given: one
        contiguous pool, of exactly the size the geometry needs). Takes the
        descriptor (closes it)."""
        try:
            if pages < 1:
                raise InvalidArgument(f"attach: a pool needs at least 1 page, not {pages}")
            size = check_pool(fd, pool_bytes(geometry, pages) if not regions else None)
            regions = list(regions) or contiguous(geometry, pages)
            check_regions(geometry, pages, regions, [size] * len(regions))
            info = os.fstat(fd)
            try:
                mapping = mmap.mmap(fd, size)
            except (OSError, ValueError) as exc:  # what the checks above did not foresee is still typed
                raise FailedPrecondition(f"attach: the pool cannot be mapped: {exc}") from None
        finally:
            os.close(fd)
        flat = torch.frombuffer(mapping, dtype=torch.uint8)
        views = [_view(_typed(flat, part), part, pages, region) for part, region in zip(_part_of(geometry), regions)]
        return _assembled(geometry, views, mapping,
                          identity=(info.st_dev, info.st_ino, tuple(r.key() for r in regions)))

    @staticmethod
    def create_sealed(geometry: KVGeometry, pages: int, name: str = "cpcache-pool") -> DevicePool:
        """The inference process's side on a host without CUDA: the pool as a
        memfd sealed against shrinking and growing, mapped here; hand `fd`
        to the daemon (`Client.attach(..., pool_fd=pool.fd)`)."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, pool_bytes(geometry, pages))
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        mapping = mmap.mmap(fd, pool_bytes(geometry, pages))
        flat = torch.frombuffer(mapping, dtype=torch.uint8)
        pool = _assembled(geometry, [_view(_typed(flat, part), part, pages, region) for part, region
                                     in zip(_part_of(geometry), contiguous(geometry, pages))], mapping)
        pool.fd = fd
        return pool

    @staticmethod
    def from_cuda_ipc(handle: dict | None, geometry: KVGeometry, pages: int,
                      regions: Sequence[Region] = ()) -> DevicePool:
        """Open a pool shared by CUDA IPC: one storage (`handle`, the fields
        of `torch.UntypedStorage._share_cuda_()` as plain bytes and ints)
        holding the layers at `regions` (none: one contiguous pool), or no
        `handle` and a storage per region (`Region.cuda_ipc`: SGLang's
        per-layer buffers, where they are)."""
        if not torch.cuda.is_available():
            raise FailedPrecondition("attach: cuda_ipc needs a CUDA device and this host has none; hand over a "
                                     "sealed memfd pool instead (attach(..., pool_fd=...))")
        if pages < 1:
            raise InvalidArgument(f"attach: a pool needs at least 1 page, not {pages}")
        regions = list(regions) or contiguous(geometry, pages)
        handles: list[dict] = []
        for region in regions:
            given = handle if handle is not None else region.cuda_ipc
            if given is None:
                raise InvalidArgument("attach: give one CUDA IPC handle for the pool, or one in every region")
            handles.append(given)
        handles = on_local_devices(handles)
        storages = _open_cuda_storages(handles)
        check_regions(geometry, pages, regions, [s.nbytes() for s in storages],
                      memory_of=[(h["device"], bytes(h["handle"])) for h in handles],
                      base_of=[int(h["storage_offset"]) for h in handles])
        views = []
        for part, storage, region in zip(_part_of(geometry), storages, regions):
            memory = _typed(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage), part)
            views.append(_view(memory, part, pages, region))
        identity = tuple((h["device"], hash(bytes(h["handle"])), h["storage_offset"], r.offset, r.strides)
                         for h, r in zip(handles, regions))
        return _assembled(geometry, views, storages, identity=identity)


def _open_cuda_storages(handles: list[dict]) -> list[torch.UntypedStorage]:
    """One storage per handle, each distinct storage opened once."""
    opened: dict[tuple, torch.UntypedStorage] = {}
    out = []
    for h in handles:
        key = (h["device"], bytes(h["handle"]), h["storage_offset"], h["storage_size"])
        if key not in opened:
            try:
                opened[key] = torch.UntypedStorage._new_shared_cuda(
                    h["device"], h["handle"], h["storage_size"], h["storage_offset"], h["ref_counter_handle"],
                    h["ref_counter_offset"], h["event_handle"], h["event_sync_required"])
            except (RuntimeError, TypeError, ValueError, KeyError) as exc:
                raise InvalidArgument(f"attach: the CUDA IPC handle cannot be opened: {exc}") from None
        out.append(opened[key])
    return out


def _part_of(geometry: KVGeometry) -> list[KVGeometry]:
    """The part each region is of, in region order."""
    return [part for part, _ in geometry.planes]


def _assembled(geometry: KVGeometry, views: list[torch.Tensor], keepalive: object, identity: tuple = ()) -> DevicePool:
    """The pool of a page's parts from the views of every region, in region order."""
    n = geometry.layers
    beside = [DevicePool(part, views[i * n : (i + 1) * n]) for i, part in enumerate(geometry.parts[1:], start=1)]
    return DevicePool(geometry, views[:n], keepalive, identity=identity, beside=beside)


def _typed(flat: torch.Tensor, geometry: KVGeometry) -> torch.Tensor:
    """Bytes as elements of the geometry's dtype (a trailing partial element dropped)."""
    whole = flat.numel() - flat.numel() % geometry.element_bytes
    return flat[:whole].view(geometry.torch_dtype)


def _view(memory: torch.Tensor, geometry: KVGeometry, pages: int, region: Region) -> torch.Tensor:
    assert region.offset % geometry.element_bytes == 0, "regions are checked (or made) aligned"
    return memory.as_strided(region_shape(geometry, pages), region.strides,
                             region.offset // geometry.element_bytes)


class HostPool:
    """The daemon's host pages, pinned when CUDA is present.

    The layouts are SGLang's host layouts (`cpcache.host_layout`).

    A stored page is always [components, layers, page_size, heads, head_dim]
    (SGLang's page_first_direct and layer_first order), whatever the host
    layout, so daemons with different layouts share storage; a page with
    parts beside its KV is the KV so, then each part so (`page_parts`). A
    page is a few contiguous runs of host memory, read and written by
    storage in place, only where that order is the memory order:
    page_first_direct. Elsewhere storage I/O goes through a staging copy.

    One memory holds every part (`host_layout.part_tensors`): `tensor` is
    the KV's, `beside` a pool per part beside it over the same memory.
    """

    def __init__(self, geometry: KVGeometry, pages: int, layout: str = "page_first_direct") -> None:
        if pages < 1:
            raise InvalidArgument(f"host pool: pages must be >= 1, got {pages}")
        size = host_layout.host_bytes(geometry, pages, layout)
        pin = torch.cuda.is_available()
        # In a memfd (host_memory.py), shared read-only with the scheduler;
        # on CUDA hosts pinned in place, else (the driver refuses) pinned
        # memory of its own that no other process can map (fd -1).
        self._mapping: mmap.mmap | None
        self.fd, self._mapping = shared_zeros(size)
        memory = torch.frombuffer(self._mapping, dtype=torch.uint8)
        if pin and not pin_in_place(self, memory):
            os.close(self.fd)
            self.fd, self._mapping = -1, None
            memory = torch.zeros(size, dtype=torch.uint8, pin_memory=True)
        self.pinned = pin
        self._memory = memory
        tensors = host_layout.part_tensors(memory, geometry, pages, layout)
        self._init_part(geometry.parts[0], pages, layout, tensors[0])
        self.geometry = geometry
        self.beside = [HostPool._part(part, pages, layout, tensor)
                       for part, tensor in zip(geometry.parts[1:], tensors[1:])]

    @staticmethod
    def _part(geometry: KVGeometry, pages: int, layout: str, tensor: torch.Tensor) -> HostPool:
        pool = HostPool.__new__(HostPool)
        pool._memory = tensor.view(-1).view(torch.uint8)
        pool._init_part(geometry, pages, layout, tensor)
        pool.fd, pool.pinned, pool.beside = -1, tensor.is_pinned(), []
        return pool

    def _init_part(self, geometry: KVGeometry, pages: int, layout: str, tensor: torch.Tensor) -> None:
        self.geometry = geometry
        self.pages = pages
        self.layout = layout
        self.tensor = tensor
        self._bytes = tensor.view(-1).view(torch.uint8).numpy()  # the same memory, as bytes
        self._base = tensor.data_ptr()
        self._page_bytes = geometry.page_bytes

    def close(self) -> None:
        """Let go of the memfd (the mapping goes with the last view of it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @functools.cached_property
    def parts(self) -> list[HostPool]:
        """A pool per part of the page (`DevicePool.parts`): [self] for a page of KV alone."""
        if not self.beside:
            return [self]
        return [HostPool._part(self.geometry.parts[0], self.pages, self.layout, self.tensor), *self.beside]

    @property
    def contiguous_pages(self) -> bool:
        """Whether storage reads and writes pages in place: in page_first_direct
        a page is one run per component and part, in stored order (the K run,
        then the V run, then each part's). The other layouts interleave
        pages, and go through a staging copy."""
        return self.layout == "page_first_direct"

    @property
    def address(self) -> int:
        """Where the pool's memory (every part) starts."""
        return self._memory.data_ptr()

    @property
    def nbytes(self) -> int:
        """The bytes of the pool's memory, every part."""
        return self._memory.numel()

    def page_view(self, first: int, count: int = 1) -> torch.Tensor:
        """Pages [first, first+count) of the KV as a [layers, components,
        pages, page_size, heads, head_dim] view (never a copy: copies into
        it land in the pool)."""
        return host_layout.page_view(self.tensor, self.geometry.parts[0], self.layout, first, count)

    def paged_layer(self, layer: int) -> torch.Tensor:
        """One layer of the KV as a [pages, components, page_size, heads,
        head_dim] view, indexed by slot on dim 0 (gathers of scattered pages)."""
        return host_layout.paged_layer(self.tensor, self.geometry.parts[0], self.layout, self.pages, layer)

    def stored_bytes(self, slot: int) -> list[torch.Tensor]:
        """One page in stored order, part by part: each part's [components,
        layers, page_size, heads, head_dim] view, as bytes (the last
        dimension head_dim x element bytes wide)."""
        return [host_layout.stored_page(part.tensor, part.geometry, self.layout, slot).view(torch.uint8)
                for part in self.parts]

    def page_parts(self, slot: int) -> list[tuple[int, memoryview]]:
        """(address, bytes) of each run of one page, in stored order, in place
        (page_first_direct only): each component of the KV, then each part's."""
        if not self.contiguous_pages:
            raise InvalidArgument(f"host pool: pages are not contiguous in the {self.layout} layout")
        return [(address + slot * run, column[slot * run : (slot + 1) * run])
                for address, column, run in self._run_columns]

    @functools.cached_property
    def _run_columns(self) -> list[tuple[int, memoryview, int]]:
        """(address, bytes, run) of each component of each part, over every
        slot: a page's runs are slices of these (a mover asks for a batch's
        pages on every storage call, so they are cut from views made once)."""
        columns = []
        for part in self.parts:
            run = part._page_bytes // part.geometry.components
            for component in range(part.geometry.components):
                start = component * self.pages * run
                columns.append((part._base + start, part._bytes.data[start : start + self.pages * run], run))
        return columns


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Group page pairs into (src_first, dst_first, count) runs where both
    sides are consecutive, so a batch of pages is a few large copies."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out
