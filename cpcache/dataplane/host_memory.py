"""The memory a daemon's host pool lies in: a memfd, so that a scheduler
whose daemon died in the middle of a load can map it read-only and copy the
layers not yet landed itself (docs/design.md rule 12), pinned for the
driver's DMA when CUDA is present (registered in place: `cudaHostRegister`
pins pages a mapping already has, where `pin_memory=True` would allocate
memory no other process can map)."""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import weakref

import torch

from cpcache.dataplane.memfd import F_SEAL_FUTURE_WRITE

log = logging.getLogger(__name__)

CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process, not only the current one


def shared_zeros(size: int) -> tuple[int, mmap.mmap]:
    """A zeroed memfd of `size` bytes, mapped: (fd, mapping)."""
    size = max(1, size)
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


def pin_in_place(owner: object, memory: torch.Tensor) -> bool:
    """Register `memory` (a CPU tensor over a mapping) with CUDA as pinned,
    for as long as `owner` lives. -> whether it is pinned now (False: the
    driver refused, the memory stays pageable and the caller pins its own)."""
    cudart = torch.cuda.cudart()
    pointer, size = memory.data_ptr(), memory.numel() * memory.element_size()
    try:
        code = cudart.cudaHostRegister(pointer, size, CUDA_HOST_REGISTER_PORTABLE)
    except RuntimeError as exc:  # torch raises on some builds rather than returning the code
        log.warning("cpcache: the host pool could not be pinned in place (%s)", exc)
        return False
    if int(code) != 0:
        log.warning("cpcache: the host pool could not be pinned in place (cudaHostRegister: error %d)", int(code))
        return False
    weakref.finalize(owner, cudart.cudaHostUnregister, pointer)
    return True
