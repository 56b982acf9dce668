"""Which GPU a CUDA IPC handle names.

A handle names its GPU by index, and each process counts indexes from its
own CUDA_VISIBLE_DEVICES: a daemon started with another one than its
scheduler's would open the handle on a different GPU than the one holding
the memory. The scheduler puts the GPU's UUID beside the index; the daemon
checks that its own GPU at that index has the same UUID."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from cpcache.errors import FailedPrecondition


def device_uuid(index: int) -> str:
    """The UUID of this process's CUDA device `index`, as nvidia-smi prints it (without "GPU-")."""
    return str(torch.cuda.get_device_properties(index).uuid)


def check_same_gpus(handles: Iterable[dict], uuid_of: Callable[[int], str] | None = None,
                    device_count: Callable[[], int] | None = None) -> None:
    """Refuse handles whose index names another GPU here than the scheduler's
    (a handle without `device_uuid`, from an older client, is not checked)."""
    uuid_of = uuid_of or device_uuid
    device_count = device_count or torch.cuda.device_count
    seen: dict[int, str] = {}
    for handle in handles:
        index, theirs = int(handle["device"]), handle.get("device_uuid") or ""
        if not theirs or seen.get(index) == theirs:
            continue
        visible = device_count()
        if not 0 <= index < visible:
            raise FailedPrecondition(
                f"attach: the pool is on the scheduler's cuda:{index} (GPU-{theirs}), and this daemon sees "
                f"{visible} CUDA device(s): start the daemon with its scheduler's CUDA_VISIBLE_DEVICES")
        ours = uuid_of(index)
        if ours != theirs:
            raise FailedPrecondition(
                f"attach: the pool is on the scheduler's cuda:{index} (GPU-{theirs}), but this daemon's "
                f"cuda:{index} is GPU-{ours}: start the daemon with its scheduler's CUDA_VISIBLE_DEVICES")
        seen[index] = theirs
