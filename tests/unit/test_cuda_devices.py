"""A CUDA IPC handle opens on the GPU that shared it: the daemon finds the
scheduler's GPU by its UUID among its own devices, whatever index each
process's CUDA_VISIBLE_DEVICES gives it, and refuses one it does not see."""

import pytest

from cpcache.cuda_devices import on_local_devices
from cpcache.errors import FailedPrecondition

pytestmark = pytest.mark.timeout(10)

GPUS = ["aaaa", "bbbb"]  # this daemon's devices 0 and 1


def uuid_of(index: int) -> str:
    return GPUS[index] if 0 <= index < len(GPUS) else ""  # "": an index this daemon does not have


def local(handles):
    return [h["device"] for h in on_local_devices(handles, uuid_of=uuid_of, device_count=lambda: len(GPUS))]


def test_the_same_gpu_at_the_same_index_keeps_it():
    assert local([dict(device=0, device_uuid="aaaa"), dict(device=1, device_uuid="bbbb")]) == [0, 1]


def test_a_gpu_the_daemon_counts_at_another_index_opens_there():
    """A scheduler with CUDA_VISIBLE_DEVICES=1 calls the daemon's cuda:1 its cuda:0."""
    assert local([dict(device=0, device_uuid="bbbb"), dict(device=3, device_uuid="aaaa")]) == [1, 0]


def test_a_gpu_the_daemon_does_not_see_is_refused_naming_it_and_the_fix():
    with pytest.raises(FailedPrecondition) as refused:
        local([dict(device=0, device_uuid="cccc")])
    message = str(refused.value)
    assert "cccc" in message and "2 CUDA device" in message and "CUDA_VISIBLE_DEVICES" in message


def test_a_handle_without_a_uuid_keeps_its_index():
    assert local([dict(device=5), dict(device=0, device_uuid="")]) == [5, 0]


def test_cuda_that_cannot_start_is_a_refusal_not_a_crash():
    def broken() -> int:
        raise RuntimeError("CUDA error: all CUDA-capable devices are busy or unavailable")

    with pytest.raises(FailedPrecondition, match="busy or unavailable"):
        on_local_devices([dict(device=0, device_uuid="aaaa")], uuid_of=lambda index: "", device_count=broken)
