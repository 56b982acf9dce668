"""A load-back whose daemon dies in the middle of its copy is finished by the
scheduler (docs/design.md rule 12): the forward reading it goes on, on the right
bytes, from the daemon's host pool that the scheduler maps read-only. The
daemon is a real `cpcached` with its copies slowed layer by layer, killed
while a forward waits on a load; a daemon stopped (SIGSTOP) past the load's
deadline is killed by the scheduler, then the load is finished."""

import signal

import pytest

from cpcache.testing.layer_overlap import GEOMETRY
from cpcache.testing.orphaned_load import loaded_by_scheduler

pytestmark = [pytest.mark.timeout(120)]


def _kill(domain):
    domain.signal(0, signal.SIGKILL)


def _term(domain):
    domain.signal(0, signal.SIGTERM)


def _stop(domain):
    domain.signal(0, signal.SIGSTOP)


async def test_a_load_whose_daemon_is_killed_mid_copy_is_finished_by_the_scheduler(run_dir):
    exit_code, landed = await loaded_by_scheduler(run_dir, _kill)
    assert exit_code == -signal.SIGKILL and landed == [True] * GEOMETRY.layers


async def test_a_load_whose_daemon_is_stuck_past_its_deadline_is_finished_once_the_daemon_is_killed(run_dir):
    # The deadline leaves a living daemon time to copy every layer (8 x 0.4 s):
    # only a stopped one is killed, by the scheduler.
    exit_code, landed = await loaded_by_scheduler(run_dir, _stop, timeout_s=6.0)
    assert exit_code == -signal.SIGKILL and landed == [True] * GEOMETRY.layers


async def test_loads_a_graceful_stop_gives_up_on_are_finished_by_the_scheduler(run_dir):
    """One copy thread, two loads (the second queued), a drain window far
    shorter than the copies (5 s, the least a 1 s agreement timeout allows,
    against two loads of 8 layers at 0.8 s a layer):
    the stop gives the queued load up, and the scheduler finishes both once
    the daemon has exited."""
    exit_code, landed = await loaded_by_scheduler(run_dir, _term, split=True, io_threads=1,
                                                   agreement_timeout_s=1.0, drain_timeout_s=5.0,
                                                   layer_delay_ms=800.0)
    assert exit_code == 0 and landed == [True] * GEOMETRY.layers
