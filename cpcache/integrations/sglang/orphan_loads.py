"""Finishing a load-back whose daemon died mid-copy, in the scheduler
(docs/design.md rule 12: no daemon death mid-load stops the forward or feeds
it wrong bytes).

A load's pages are in the daemon's host pool before the load opens (the
agreed state says so), and they stay there while it is open. The daemon
offers that pool read-only (a memfd, `AttachReply.host_pool_ticket`); the
scheduler maps it at attach, follows where each resident page lies (the
slots every reply names), and knows its daemon's process by the pidfd the
daemon handed over itself (`DaemonProcess`: no pid looked up, so none
reused, and across pid namespaces). When
a forward waits on a load that its daemon can no longer finish (the
process is gone, or stuck past the load's deadline and then killed here),
the scheduler copies the layers the board does not show as landed itself,
from the host pool into the device pages, and the forward goes on.

The copy starts only once the daemon's process has exited (the pidfd says
so): no copy of a living daemon can land after it. A stuck daemon this
scheduler may not signal (another user without the right to) is not
finished for: the forward stops as before.

On a CUDA host the pool is the same memfd, pinned in place by the daemon
(`dataplane/host_memory.py`; a daemon whose driver refuses that pins memory
of its own, offers none, and a load it dies in the middle of stops the
forward as before). The daemon publishes a layer there once its copy's
event has completed, so the board says landed, as on a CPU host: the
forward waits only on events that completed, and the layers the board
does not show are copied here after the daemon's exit (its context, and
every copy queued on it, end with its process, before the pidfd says so).
"""

from __future__ import annotations

import logging
import mmap
import os
import warnings
from collections.abc import Sequence

import torch

from cpcache import host_layout
from cpcache.client.daemon_process import DaemonProcess
from cpcache.geometry import KVGeometry

log = logging.getLogger(__name__)


class OrphanLoads:
    """The host pool of this rank's daemon, read-only, and its process."""

    def __init__(self, fd: int, daemon: DaemonProcess, geometry: KVGeometry, host_pages: int, layout: str,
                 device_buffers: Sequence[tuple[torch.Tensor, ...]]) -> None:
        """Takes `fd`; `daemon` stays its caller's. `device_buffers`: per region
        (`KVGeometry.planes`), the forward's buffers in component order,
        [rows, heads, head_dim] each."""
        self.geometry = geometry
        self._pages = host_pages
        self._layout = layout
        self._device = device_buffers
        try:
            size = os.fstat(fd).st_size
            self._mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # read-only memory, only ever read
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self._host = host_layout.part_tensors(flat, geometry, host_pages, layout)  # a pool per part
        self._daemon = daemon

    def daemon_gone(self) -> bool:
        """Whether the daemon's process has exited (it can land nothing more)."""
        return self._daemon.gone()

    def stop_daemon(self, timeout_s: float) -> bool:
        """Make sure the daemon lands nothing more: kill it if it still runs
        (stuck past a load's deadline), and wait for its exit. -> whether it
        has exited (False: it may not be signalled, or did not exit)."""
        if not self._daemon.gone():
            log.error("cpcache: killing this rank's daemon: it was stuck past a load's deadline while a forward "
                      "waited on it (its service manager restarts it)")
        return self._daemon.stop(timeout_s)

    def copy(self, host_slots: Sequence[int], device_pages: Sequence[int], first_layer: int) -> None:
        """Copy pages at `host_slots` of the host pool into `device_pages` of
        the forward's buffers, layers `first_layer` onwards (every part of them)."""
        g = self.geometry
        slots = torch.tensor(list(host_slots), dtype=torch.long)
        pages = torch.tensor(list(device_pages), dtype=torch.long)
        for layer in range(max(0, first_layer), g.layers):
            for index, (part, pool) in enumerate(zip(g.parts, self._host)):
                s = part.page_size
                host = host_layout.paged_layer(pool, part, self._layout, self._pages, layer)[slots]
                for component, buffer in enumerate(self._device[index * g.layers + layer]):
                    rows = buffer.shape[0] - buffer.shape[0] % s
                    paged = buffer[:rows].unflatten(0, (rows // s, s))
                    paged[pages.to(buffer.device)] = host[:, component].to(buffer.device)

    def close(self) -> None:
        """Nothing of its own to let go: the mapping goes with the object, the daemon's process is its caller's."""
