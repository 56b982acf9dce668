"""The device pool an Attach hands over, opened: a sealed memfd taken by
its ticket from the `.pools` socket, or CUDA storage by IPC handle (one for
the pool, or one per region), with the load-signal board beside it."""

from __future__ import annotations

import logging
from collections.abc import Callable

from cpcache.daemon.wire import AttachAsk, CudaPool, ShmPool
from cpcache.dataplane.pools import DevicePool
from cpcache.dataplane.signal_board import open_board

log = logging.getLogger("cpcache.daemon")

Take = Callable[[str], tuple[int, int, int]]  # a handed-over descriptor by ticket: -> (fd, uid, pid)


def open_device(ask: AttachAsk, take: Take) -> DevicePool:
    """Blocking (mapping a pool, opening IPC handles): run on a thread."""
    pool = ask.pool
    if isinstance(pool, CudaPool):
        device = DevicePool.from_cuda_ipc(pool.handle, ask.geometry, ask.device_pages, ask.regions)
    else:
        assert isinstance(pool, ShmPool)
        fd, uid, pid = take(pool.ticket)
        device = DevicePool.from_fd(fd, ask.geometry, ask.device_pages, ask.regions)
        log.info("attach: pool of %d pages (%s) handed over by pid %d (uid %d)", ask.device_pages,
                 f"{len(ask.regions)} regions" if ask.regions else "contiguous", pid, uid)
    signals = ask.signals
    if signals is not None:
        fd, _, _ = take(signals.ticket)
        device.signals = open_board(fd, signals.slots, ask.geometry.layers, signals.cuda_events,
                                    device.layers[0].device)
        # Another board is another attach, not a retry of the last one.
        device.identity = (*device.identity, device.signals.identity)
        log.info("attach: load-signal board of %d slots%s", signals.slots,
                 " with CUDA events" if signals.cuda_events else "")
    return device
