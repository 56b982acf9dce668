"""A load-back whose daemon is killed in the middle of its copy into the
scheduler's CUDA buffers is finished by the scheduler (docs/design.md rule
12): the daemon's host pool is a memfd pinned in place, which the scheduler
maps read-only; once the daemon's process has exited (its context, and the
copies queued on it, gone with it), every layer is copied again from there
and the forward reads the right bytes."""

import signal

import pytest
import torch

from cpcache.testing.layer_overlap import GEOMETRY
from cpcache.testing.orphaned_load import loaded_by_scheduler

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(180),
]


async def test_a_load_whose_daemon_is_killed_mid_copy_on_a_gpu_is_finished_by_the_scheduler(run_dir):
    exit_code, landed = await loaded_by_scheduler(run_dir, lambda domain: domain.signal(0, signal.SIGKILL),
                                                  device="cuda")
    assert exit_code == -signal.SIGKILL and landed == [True] * GEOMETRY.layers


async def test_a_gpu_load_whose_daemon_is_stuck_is_finished_once_the_scheduler_killed_it(run_dir):
    exit_code, landed = await loaded_by_scheduler(run_dir, lambda domain: domain.signal(0, signal.SIGSTOP),
                                                  device="cuda", timeout_s=6.0)
    assert exit_code == -signal.SIGKILL and landed == [True] * GEOMETRY.layers
