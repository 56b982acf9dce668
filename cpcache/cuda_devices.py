"""Which GPU a CUDA IPC handle names.

A handle names its GPU by index, and each process counts indexes from its
own CUDA_VISIBLE_DEVICES (and CUDA_DEVICE_ORDER): the daemon's index of the
scheduler's GPU can differ from the scheduler's. The scheduler puts the
GPU's UUID beside the index; the daemon opens the handle on its own index
of that UUID, and refuses a GPU it does not see."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from cpcache.errors import FailedPrecondition


def device_uuid(index: int) -> str:
    """The UUID of this process's CUDA device `index` (a MIG instance's own
    on MIG), or "" where torch cannot tell it."""
    try:
        return str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    except Exception:  # noqa: BLE001 - a device that cannot be read is one whose UUID is not known
        return ""


def on_local_devices(handles: Iterable[dict], uuid_of: Callable[[int], str] | None = None,
                     device_count: Callable[[], int] | None = None) -> list[dict]:
    """The handles with `device` set to this process's index of the GPU that
    shared each (its `device_uuid`); a handle without one, from an older
    client or a GPU that reports none, keeps its index. `uuid_of` answers
    "" for an index it cannot read, as `device_uuid` does."""
    uuid_of = uuid_of or device_uuid
    device_count = device_count or torch.cuda.device_count
    local: dict[str, int] | None = None
    out = []
    for handle in handles:
        theirs = handle.get("device_uuid") or ""
        index = int(handle["device"])
        if theirs and uuid_of(index) != theirs:
            if local is None:
                local = _local_indexes(uuid_of, device_count)
            if theirs not in local:
                raise FailedPrecondition(
                    f"attach: the pool is on the scheduler's cuda:{index}, GPU {theirs}, which is not among "
                    f"this daemon's {len(local)} CUDA device(s): make that GPU visible to the daemon "
                    "(CUDA_VISIBLE_DEVICES)")
            index = local[theirs]
        out.append(dict(handle, device=index))
    return out


def _local_indexes(uuid_of: Callable[[int], str], device_count: Callable[[], int]) -> dict[str, int]:
    try:
        count = device_count()
    except Exception as exc:  # noqa: BLE001 - CUDA that cannot start here is a refusal, not a daemon bug
        raise FailedPrecondition(f"attach: this daemon cannot list its CUDA devices: {exc}") from None
    return {uuid: i for i in range(count) if (uuid := uuid_of(i))}

