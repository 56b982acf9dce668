"""A load-back whose daemon dies in the middle of its copy is finished by the
scheduler (DESIGN rule 12): the forward reading it goes on, on the right
bytes, from the daemon's host pool that the scheduler maps read-only. The
daemon is a real `cpcached` with its copies slowed layer by layer, killed
while a forward waits on a load; a daemon stopped (SIGSTOP) past the load's
deadline is killed by the scheduler, then the load is finished."""

import signal

import pytest
import torch

from cpcache.client import Client, SchedulerSession
from cpcache.client.pools import take_host_pool
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.integrations.sglang.layer_loads import LayerLoads, OpenLoad
from cpcache.integrations.sglang.orphan_loads import OrphanLoads
from cpcache.testing.layer_overlap import GEOMETRY, KEYS, PAGES, SOURCE, TARGET, _pool, _rows
from cpcache.topology import Topology

pytestmark = [pytest.mark.timeout(120)]

LAYER_DELAY_MS = 400.0  # each layer of a load-back: a copy of 8 layers takes over 3 s


async def _loaded_by_scheduler(run_dir, fault, timeout_s=30.0):
    """Write pages through, open a load of them, hit the daemon with `fault`
    once its first layer landed, then run a forward over the load: -> per
    layer, whether the forward read the pages written."""
    layers, attach = _pool("cpu")
    spec = DomainSpec(Topology(tp=1), run_dir,
                      extra=dict(host_pool_pages=16, fault_copy_layer_delay_ms=LAYER_DELAY_MS))
    async with LocalDomain(spec) as domain:
        loads = LayerLoads(GEOMETRY.layers, timeout_s=timeout_s, slots=4)
        with Client(domain.sockets[0], timeout_s=30) as client:
            attached = client.attach("orphans", GEOMETRY, PAGES, pool_fd=attach["pool_fd"],
                                     load_signals=loads.signals)
            loads.signals.close_fd()
            assert attached.host_pool_ticket, "a daemon without CUDA offers its host pool"
            fd, pid = take_host_pool(domain.sockets[0], attached.host_pool_ticket)
            buffers = [tuple(layer[c] for c in range(GEOMETRY.components)) for layer in layers]
            loads.orphans = OrphanLoads(fd, pid, GEOMETRY, attached.host_pages, attached.host_layout, buffers)
            session = SchedulerSession(client, first_step=client.status().last_step + 1, epoch=attached.epoch)
            stored: list[bool] = []
            session.write_through(KEYS, SOURCE, done=stored.append)
            while not stored:
                session.flush()
            assert stored == [True]
            expected = [_rows(layer, SOURCE).clone() for layer in layers]
            for layer in layers:
                _rows(layer, TARGET).zero_()
            opened = session.load_opened(KEYS, TARGET, loads.signals)
            assert opened is not None
            loads.opened(OpenLoad(*opened, tuple(session.host.slots(KEYS)), tuple(TARGET)))
            loads.set_consumer(loads.start_batch())
            loads.wait_until(0)  # the first layer landed: the copy is under way
            fault(domain)
            for layer in range(GEOMETRY.layers):
                loads.wait_until(layer)
            return [torch.equal(_rows(layer, TARGET), want) for layer, want in zip(layers, expected)]


def _kill(domain):
    domain.signal(0, signal.SIGKILL)


def _stop(domain):
    domain.signal(0, signal.SIGSTOP)


async def test_a_load_whose_daemon_is_killed_mid_copy_is_finished_by_the_scheduler(run_dir):
    assert await _loaded_by_scheduler(run_dir, _kill) == [True] * GEOMETRY.layers


async def test_a_load_whose_daemon_is_stuck_past_its_deadline_is_finished_once_the_daemon_is_killed(run_dir):
    assert await _loaded_by_scheduler(run_dir, _stop, timeout_s=2.0) == [True] * GEOMETRY.layers
