"""A load-back whose daemon dies in the middle of its copy is finished by the
scheduler (docs/design.md rule 12): the forward reading it goes on, on the right
bytes, from the daemon's host pool that the scheduler maps read-only. The
daemon is a real `cpcached` with its copies slowed layer by layer, killed
while a forward waits on a load; a daemon stopped (SIGSTOP) past the load's
deadline is killed by the scheduler, then the load is finished."""

import signal
import time

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


async def _loaded_by_scheduler(run_dir, fault, timeout_s=30.0, split=False, agreement_timeout_s=10.0, **settings):
    """Write pages through, open a load of them (`split`: two loads, the
    second queued behind the first), hit the daemon with `fault` once the
    first layer landed, then run a forward over the loads: -> the daemon's
    exit code, and per layer whether the forward read the pages written."""
    layers, attach = _pool("cpu")
    spec = DomainSpec(Topology(tp=1), run_dir, agreement_timeout_s=agreement_timeout_s,
                      extra=dict(host_pool_pages=16, fault_copy_layer_delay_ms=LAYER_DELAY_MS, **settings))
    async with LocalDomain(spec) as domain:
        loads = LayerLoads(GEOMETRY.layers, timeout_s=timeout_s, slots=4)
        with Client(domain.sockets[0], timeout_s=30) as client:
            attached = client.attach("orphans", GEOMETRY, PAGES, pool_fd=attach["pool_fd"],
                                     load_signals=loads.signals)
            loads.signals.close_fd()
            assert attached.host_pool_ticket, "a daemon without CUDA offers its host pool"
            fd, _ = take_host_pool(domain.sockets[0], attached.host_pool_ticket)
            daemon = client.identify()  # its process by the pidfd it hands over
            buffers = [tuple(layer[c] for c in range(GEOMETRY.components)) for layer in layers]
            loads.orphans = OrphanLoads(fd, daemon.process, GEOMETRY, attached.host_pages, attached.host_layout,
                                        buffers)
            session = SchedulerSession(client, first_step=client.status().last_step + 1, epoch=attached.epoch)
            stored: list[bool] = []
            session.write_through(KEYS, SOURCE, done=stored.append)
            while not stored:
                session.flush()
            assert stored == [True]
            expected = [_rows(layer, SOURCE).clone() for layer in layers]
            for layer in layers:
                _rows(layer, TARGET).zero_()
            halves = [(KEYS[:2], TARGET[:2]), (KEYS[2:], TARGET[2:])] if split else [(KEYS, TARGET)]
            first = None
            for keys, target in halves:
                opened = session.load_opened(keys, target, loads.signals)
                assert opened is not None
                first = first or opened
                loads.opened(OpenLoad(*opened, tuple(session.host.slots(keys)), tuple(target)))
            loads.set_consumer(loads.start_batch())
            op, slot = first
            assert loads.signals.wait(slot, op, 1, time.monotonic() + 30)  # the first copy is under way
            fault(domain)
            for layer in range(GEOMETRY.layers):
                loads.wait_until(layer)
            exit_code = await domain.wait_exit(0, 30)
            daemon.close()
            return exit_code, [torch.equal(_rows(layer, TARGET), want) for layer, want in zip(layers, expected)]


def _kill(domain):
    domain.signal(0, signal.SIGKILL)


def _term(domain):
    domain.signal(0, signal.SIGTERM)


def _stop(domain):
    domain.signal(0, signal.SIGSTOP)


async def test_a_load_whose_daemon_is_killed_mid_copy_is_finished_by_the_scheduler(run_dir):
    exit_code, landed = await _loaded_by_scheduler(run_dir, _kill)
    assert exit_code == -signal.SIGKILL and landed == [True] * GEOMETRY.layers


async def test_a_load_whose_daemon_is_stuck_past_its_deadline_is_finished_once_the_daemon_is_killed(run_dir):
    # The deadline leaves a living daemon time to copy every layer (8 x 0.4 s):
    # only a stopped one is killed, by the scheduler.
    exit_code, landed = await _loaded_by_scheduler(run_dir, _stop, timeout_s=6.0)
    assert exit_code == -signal.SIGKILL and landed == [True] * GEOMETRY.layers


async def test_loads_a_graceful_stop_gives_up_on_are_finished_by_the_scheduler(run_dir):
    """One copy thread, two loads (the second queued), a drain window far
    shorter than the copies (the least a 1 s agreement timeout allows):
    the stop gives the queued load up, and the scheduler finishes both once
    the daemon has exited."""
    exit_code, landed = await _loaded_by_scheduler(run_dir, _term, split=True, io_threads=1,
                                                   agreement_timeout_s=1.0, drain_timeout_s=2.0)
    assert exit_code == 0 and landed == [True] * GEOMETRY.layers
