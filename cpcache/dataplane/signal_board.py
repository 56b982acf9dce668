"""The daemon's side of a scheduler's load-signal board (`cpcache/load_signals.py`):
handed over by descriptor like a pool, checked like one (a shmem memfd,
sealed against shrinking and growing, open for writing), and on CUDA hosts
one IPC event per slot and layer, which the mover records after each
layer's copies. The daemon writes only the progress word of each slot
(op tag and layers copied in one 8-byte store), and only while the claim
word names its op."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from cpcache.dataplane.memfd import check_pool
from cpcache.errors import FailedPrecondition, InvalidArgument
from cpcache.load_signals import MAX_LAYERS, LoadSignals


def open_board(fd: int, slots: int, layers: int, cuda_events: Sequence[bytes] = (),
               device: torch.device | None = None) -> LoadSignals:
    """Map a board handed over by descriptor (takes the descriptor); with
    `cuda_events`, open them on `device`, the attached pool's CUDA device."""
    try:
        if layers > MAX_LAYERS:  # the progress field would run into the op tag
            raise InvalidArgument(f"attach: load signals count up to {MAX_LAYERS} layers, the model has {layers}")
        if device is not None and device.type == "cuda" and not cuda_events:
            raise InvalidArgument("attach: load signals of a CUDA pool need a CUDA event per slot and layer: "
                                  "a layer published as queued has not landed until its event completes")
        size = check_pool(fd, None, "load-signal board")
        info = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    signals = LoadSignals.mapped(fd, size, slots)
    if cuda_events:
        signals.events = _events(cuda_events, slots, layers, device)
    signals.identity = (info.st_dev, info.st_ino, slots, hash(tuple(cuda_events)))
    return signals


def _events(handles: Sequence[bytes], slots: int, layers: int, device: torch.device | None) -> list[list]:
    if len(handles) != slots * layers:
        raise InvalidArgument(f"attach: load_signals needs one CUDA event per slot and layer ({slots} x {layers}), "
                              f"got {len(handles)}")
    if device is None or device.type != "cuda":
        raise InvalidArgument("attach: CUDA events of load signals need a pool on a CUDA device")
    try:
        events = [torch.cuda.Event.from_ipc_handle(device, handle) for handle in handles]
    except RuntimeError as exc:
        raise FailedPrecondition(f"attach: a load-signal CUDA event cannot be opened: {exc}") from None
    return [events[s * layers : (s + 1) * layers] for s in range(slots)]
