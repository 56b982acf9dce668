"""A CUDA IPC handle opens only on the GPU that shared it: the daemon
compares the scheduler's UUID for the handle's device index with its own."""

import pytest

from cpcache.cuda_devices import check_same_gpus
from cpcache.errors import FailedPrecondition

pytestmark = pytest.mark.timeout(10)

GPUS = ["aaaa", "bbbb"]  # this daemon's devices 0 and 1


def check(handles):
    check_same_gpus(handles, uuid_of=GPUS.__getitem__, device_count=lambda: len(GPUS))


def test_same_gpu_at_the_same_index_passes():
    check([dict(device=0, device_uuid="aaaa"), dict(device=1, device_uuid="bbbb")])


def test_another_gpu_at_that_index_is_refused_naming_both_and_the_fix():
    with pytest.raises(FailedPrecondition) as refused:
        check([dict(device=0, device_uuid="bbbb")])
    message = str(refused.value)
    assert "GPU-bbbb" in message and "GPU-aaaa" in message and "CUDA_VISIBLE_DEVICES" in message


def test_an_index_this_daemon_does_not_see_is_refused():
    with pytest.raises(FailedPrecondition, match="sees 2 CUDA device"):
        check([dict(device=3, device_uuid="cccc")])


def test_a_handle_without_a_uuid_is_not_checked():
    check([dict(device=5), dict(device=0, device_uuid="")])
