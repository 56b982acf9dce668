"""The two memory tiers a daemon touches: the device pool (owned by the
inference process, attached once) and the host pool (owned by the daemon).

Both are torch tensors. A page is addressed by an index; `page_view` gives a
[layers, components, pages, page_size, heads, head_dim] view of a run of
pages in either pool, so a copy between tiers is one `copy_` per run of consecutive pages,
whatever the layouts.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from dataclasses import dataclass

import numpy as np
import torch

from cpcache.dataplane.memfd import check_pool
from cpcache.errors import FailedPrecondition, InvalidArgument
from cpcache.geometry import KVGeometry

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass
class DevicePool:
    """The inference process's KV pool: [layers, components, tokens, heads, head_dim]."""

    geometry: KVGeometry
    tensor: torch.Tensor
    _keepalive: object = None  # the mapping behind a shared-memory pool
    fd: int = -1  # the creator's descriptor of a memfd pool, to hand over
    identity: tuple[int, ...] = ()  # which memory this is (device and inode of a memfd), to tell a retry

    @property
    def pages(self) -> int:
        return self.tensor.shape[2] // self.geometry.page_size

    def page_view(self, first: int, count: int = 1) -> torch.Tensor:
        """Pages [first, first+count) as a [layers, components, pages, page_size,
        heads, head_dim] view."""
        s = self.geometry.page_size
        return self.tensor[:, :, first * s : (first + count) * s].unflatten(2, (count, s))

    @staticmethod
    def from_fd(fd: int, geometry: KVGeometry, pages: int) -> DevicePool:
        """Map a pool handed over by descriptor (hosts without CUDA): a shmem
        memfd, open for writing, sealed against shrinking and growing, of
        exactly the size the geometry needs (`memfd.check_pool`). Takes the
        descriptor (closes it)."""
        need = geometry.page_bytes * pages
        try:
            if pages < 1:
                raise InvalidArgument(f"attach: a pool needs at least 1 page, not {pages}")
            check_pool(fd, need)
            info = os.fstat(fd)
            try:
                mapping = mmap.mmap(fd, need)
            except (OSError, ValueError) as exc:  # what the checks above did not foresee is still typed
                raise FailedPrecondition(f"attach: the pool cannot be mapped: {exc}") from None
        finally:
            os.close(fd)
        flat = torch.frombuffer(mapping, dtype=torch.uint8)
        tensor = flat.view(geometry.torch_dtype).view(geometry.pool_shape(pages))
        return DevicePool(geometry, tensor, mapping, identity=(info.st_dev, info.st_ino))

    @staticmethod
    def create_sealed(geometry: KVGeometry, pages: int, name: str = "cpcache-pool") -> DevicePool:
        """The inference process's side on a host without CUDA: the pool as a
        memfd sealed against shrinking and growing, mapped here; hand `fd`
        to the daemon (`Client.attach(..., pool_fd=pool.fd)`)."""
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, geometry.page_bytes * pages)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        mapping = mmap.mmap(fd, geometry.page_bytes * pages)
        flat = torch.frombuffer(mapping, dtype=torch.uint8)
        pool = DevicePool(geometry, flat.view(geometry.torch_dtype).view(geometry.pool_shape(pages)), mapping)
        pool.fd = fd
        return pool

    @staticmethod
    def from_cuda_ipc(handle: dict, geometry: KVGeometry, pages: int) -> DevicePool:
        """Open a pool shared by CUDA IPC. `handle` holds the fields of
        `torch.UntypedStorage._share_cuda_()`, sent as plain bytes and ints."""
        if not torch.cuda.is_available():
            raise FailedPrecondition("attach: cuda_ipc needs a CUDA device and this host has none; hand over a "
                                     "sealed memfd pool instead (attach(..., pool_fd=...))")
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                handle["device"], handle["handle"], handle["storage_size"], handle["storage_offset"],
                handle["ref_counter_handle"], handle["ref_counter_offset"], handle["event_handle"],
                handle["event_sync_required"],
            )
        except (RuntimeError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"attach: the CUDA IPC handle cannot be opened: {exc}") from None
        need = geometry.page_bytes * pages
        if storage.nbytes() < need:
            raise InvalidArgument(f"attach: the CUDA pool holds {storage.nbytes()} bytes, {need} needed")
        flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)[:need]
        identity = (handle["device"], hash(bytes(handle["handle"])), handle["storage_offset"])
        return DevicePool(geometry, flat.view(geometry.torch_dtype).view(geometry.pool_shape(pages)), storage,
                          identity=identity)


class HostPool:
    """The daemon's host pages, pinned when CUDA is present.

    The layouts are SGLang's host layouts, byte for byte (pool_host/mha.py,
    pool_host/mla.py), with the K/V component outermost (MLA has one):
      layer_first        [components, layers, tokens, heads, head_dim]
      page_first         [components, tokens, layers, heads, head_dim]
      page_first_direct  [components, pages, layers, page_size, heads, head_dim]

    A stored page is always [components, layers, page_size, heads, head_dim]
    (SGLang's page_first_direct and layer_first order), whatever the host
    layout, so daemons with different layouts share storage. A page is one
    contiguous run of host memory, read and written by storage in place, only
    where that order is the memory order: page_first_direct with one
    component (MLA). Elsewhere storage I/O goes through a staging copy.
    """

    def __init__(self, geometry: KVGeometry, pages: int, layout: str = "page_first_direct") -> None:
        if layout not in LAYOUTS:
            raise InvalidArgument(f"host pool: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if pages < 1:
            raise InvalidArgument(f"host pool: pages must be >= 1, got {pages}")
        self.geometry = geometry
        self.pages = pages
        self.layout = layout
        g = geometry
        c, tokens = g.components, pages * g.page_size
        shape = {
            "layer_first": (c, g.layers, tokens, g.heads, g.head_dim),
            "page_first": (c, tokens, g.layers, g.heads, g.head_dim),
            "page_first_direct": (c, pages, g.layers, g.page_size, g.heads, g.head_dim),
        }[layout]
        pin = torch.cuda.is_available()
        self.tensor = torch.zeros(shape, dtype=g.torch_dtype, pin_memory=pin)
        self.pinned = pin
        self._bytes = self.tensor.view(-1).view(torch.uint8).numpy()  # the same memory, as bytes
        self._base = self.tensor.data_ptr()
        self._page_bytes = geometry.page_bytes

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
        s = self.geometry.page_size
        if self.layout == "layer_first":  # [C, L, n*s, H, D]
            return self.tensor[:, :, first * s : (first + count) * s].unflatten(2, (count, s)).permute(1, 0, 2, 3, 4, 5)
        if self.layout == "page_first":  # [C, n*s, L, H, D]
            return self.tensor[:, first * s : (first + count) * s].unflatten(1, (count, s)).permute(3, 0, 1, 2, 4, 5)
        return self.tensor[:, first : first + count].permute(2, 0, 1, 3, 4, 5)  # [C, n, L, s, H, D]

    def stored_view(self, slot: int) -> torch.Tensor:
        """One page in stored order, [components, layers, page_size, heads, head_dim] (a view)."""
        return self.page_view(slot)[:, :, 0].transpose(0, 1)

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
