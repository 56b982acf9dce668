"""The two memory tiers a daemon touches: the device pool (owned by the
inference process, attached once) and the host pool (owned by the daemon).

Both are torch tensors. A page is addressed by an index. The device pool is
a view per layer (`regions`: SGLang's buffers where they lie) and
`DevicePool.layer_pages` gives one layer's run of pages; the host pool's
`page_view` gives a [layers, components, pages, page_size, heads, head_dim]
view of a run, so a copy between tiers is one `copy_` per layer per run of
consecutive pages, whatever the layouts.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cpcache import host_layout
from cpcache.cuda_devices import on_local_devices
from cpcache.dataplane.memfd import check_pool
from cpcache.dataplane.regions import check as check_regions
from cpcache.dataplane.regions import contiguous, region_shape
from cpcache.errors import FailedPrecondition, InvalidArgument
from cpcache.geometry import KVGeometry, Region
from cpcache.host_layout import host_shape
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
        """The whole pool as one [layers, components, rows, heads, head_dim]
        view, where its layers lie at one stride in one memory (a pool made
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
        """Pages [first, first+count) of a pool at one stride (`tensor`) as a
        [layers, components, pages, page_size, heads, head_dim] view."""
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
            size = check_pool(fd, geometry.page_bytes * pages if not regions else None)
            regions = list(regions) or contiguous(geometry, pages)
            check_regions(geometry, pages, regions, [size] * len(regions))
            info = os.fstat(fd)
            try:
                mapping = mmap.mmap(fd, size)
            except (OSError, ValueError) as exc:  # what the checks above did not foresee is still typed
                raise FailedPrecondition(f"attach: the pool cannot be mapped: {exc}") from None
        finally:
            os.close(fd)
        memory = _typed(torch.frombuffer(mapping, dtype=torch.uint8), geometry)
        layers = [_view(memory, geometry, pages, region) for region in regions]
        return DevicePool(geometry, layers, mapping,
                          identity=(info.st_dev, info.st_ino, tuple(r.key() for r in regions)))

    @staticmethod
    def create_sealed(geometry: KVGeometry, pages: int, name: str = "cpcache-pool") -> DevicePool:
        """The inference process's side on a host without CUDA: the pool as a
        memfd sealed against shrinking and growing, mapped here; hand `fd`
        to the daemon (`Client.attach(..., pool_fd=pool.fd)`)."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, geometry.page_bytes * pages)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        mapping = mmap.mmap(fd, geometry.page_bytes * pages)
        memory = _typed(torch.frombuffer(mapping, dtype=torch.uint8), geometry)
        pool = DevicePool(geometry, [_view(memory, geometry, pages, r) for r in contiguous(geometry, pages)],
                          mapping)
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
        layers = []
        for storage, region in zip(storages, regions):
            memory = _typed(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage), geometry)
            layers.append(_view(memory, geometry, pages, region))
        identity = tuple((h["device"], hash(bytes(h["handle"])), h["storage_offset"], r.offset, r.strides)
                         for h, r in zip(handles, regions))
        return DevicePool(geometry, layers, storages, identity=identity)


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


def _typed(flat: torch.Tensor, geometry: KVGeometry) -> torch.Tensor:
    """Bytes as elements of the geometry's dtype (a trailing partial element dropped)."""
    whole = flat.numel() - flat.numel() % geometry.element_bytes
    return flat[:whole].view(geometry.torch_dtype)


def _view(memory: torch.Tensor, geometry: KVGeometry, pages: int, region: Region) -> torch.Tensor:
    return memory.as_strided(region_shape(geometry, pages), region.strides,
                             region.offset // geometry.element_bytes)


class HostPool:
    """The daemon's host pages, pinned when CUDA is present.

    The layouts are SGLang's host layouts (`cpcache.host_layout`).

    A stored page is always [components, layers, page_size, heads, head_dim]
    (SGLang's page_first_direct and layer_first order), whatever the host
    layout, so daemons with different layouts share storage. A page is one
    contiguous run of host memory, read and written by storage in place, only
    where that order is the memory order: page_first_direct with one
    component (MLA). Elsewhere storage I/O goes through a staging copy.
    """

    def __init__(self, geometry: KVGeometry, pages: int, layout: str = "page_first_direct") -> None:
        if pages < 1:
            raise InvalidArgument(f"host pool: pages must be >= 1, got {pages}")
        shape = host_shape(geometry, pages, layout)
        self.geometry = geometry
        self.pages = pages
        self.layout = layout
        pin = torch.cuda.is_available()
        self.fd = -1  # a memfd the pool lies in, to share read-only with the scheduler (-1: none)
        if pin:
            self.tensor = torch.zeros(shape, dtype=geometry.torch_dtype, pin_memory=True)
        else:
            # In a memfd, so that a scheduler whose daemon died mid-load can
            # map it and copy the layers not yet landed itself.
            self.fd, self._mapping = _shared_zeros(geometry.torch_dtype, shape)
            self.tensor = torch.frombuffer(self._mapping, dtype=geometry.torch_dtype).view(shape)
        self.pinned = pin
        self._bytes = self.tensor.view(-1).view(torch.uint8).numpy()  # the same memory, as bytes
        self._base = self.tensor.data_ptr()
        self._page_bytes = geometry.page_bytes

    def close(self) -> None:
        """Let go of the memfd (the mapping goes with the last view of it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def contiguous_pages(self) -> bool:
        """Whether storage reads and writes pages in place: in page_first_direct
        a page is one run per component, in stored order (the K run, then
        the V run). The other layouts interleave pages, and go through a
        staging copy."""
        return self.layout == "page_first_direct"

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def page_view(self, first: int, count: int = 1) -> torch.Tensor:
        """Pages [first, first+count) as a [layers, components, pages, page_size,
        heads, head_dim] view (never a copy: copies into it land in the pool)."""
        return host_layout.page_view(self.tensor, self.geometry, self.layout, first, count)

    def paged_layer(self, layer: int) -> torch.Tensor:
        """One layer as a [pages, components, page_size, heads, head_dim]
        view, indexed by slot on dim 0 (gathers of scattered pages)."""
        return host_layout.paged_layer(self.tensor, self.geometry, self.layout, self.pages, layer)

    def stored_view(self, slot: int) -> torch.Tensor:
        """One page in stored order, [components, layers, page_size, heads, head_dim] (a view)."""
        return host_layout.stored_page(self.tensor, self.geometry, self.layout, slot)

    def page_parts(self, slot: int) -> list[tuple[int, np.ndarray]]:
        """(address, bytes) of each run of one page, in stored order, in place
        (page_first_direct only)."""
        if not self.contiguous_pages:
            raise InvalidArgument(f"host pool: pages are not contiguous in the {self.layout} layout")
        run = self._page_bytes // self.geometry.components
        parts = []
        for component in range(self.geometry.components):
            start = (component * self.pages + slot) * run
            parts.append((self._base + start, self._bytes[start : start + run]))
        return parts


F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1


def _shared_zeros(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, mmap.mmap]:
    """A zeroed memfd of `shape` elements of `dtype`, mapped: (fd, mapping)."""
    size = max(1, int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size())
    fd = os.memfd_create("cpcache-host-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
        # Only this mapping may write: whoever is handed the memfd (the
        # scheduler, read-only) can neither map it writable nor write it,
        # even through a new open of /proc/PID/fd.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE)
        return fd, mapping
    except BaseException:
        os.close(fd)
        raise


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
