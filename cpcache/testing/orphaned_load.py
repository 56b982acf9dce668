"""A load-back whose daemon is hit by a fault in the middle of its copy,
with a forward waiting on it (docs/design.md rule 12): the scenario of
tests/daemon/test_orphan_loads.py on this host's memory, and of
tests/gpu/test_orphan_loads_cuda.py on a GPU (the daemon copying into the
scheduler's CUDA buffers and recording an IPC event per layer)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from cpcache.client import Client, SchedulerSession
from cpcache.client.pools import take_host_pool
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.integrations.sglang.layer_loads import LayerLoads, OpenLoad
from cpcache.integrations.sglang.orphan_loads import OrphanLoads
from cpcache.testing.layer_overlap import GEOMETRY, KEYS, PAGES, SOURCE, TARGET, _pool, _rows
from cpcache.topology import Topology

LAYER_DELAY_MS = 400.0  # each layer of a load-back: a copy of 8 layers takes over 3 s


async def loaded_by_scheduler(run_dir: Path, fault: Callable[[LocalDomain], None], *, device: str = "cpu",
                              timeout_s: float = 30.0, split: bool = False, agreement_timeout_s: float = 10.0,
                              layer_delay_ms: float = LAYER_DELAY_MS, **settings: object
                              ) -> tuple[int | None, list[bool]]:
    """Write pages through, open a load of them (`split`: two loads, the
    second queued behind the first), hit the daemon with `fault` once the
    first layer landed, then run a forward over the loads: -> the daemon's
    exit code, and per layer whether the forward read the pages written."""
    layers, attach = _pool(device)
    spec = DomainSpec(Topology(tp=1), run_dir, agreement_timeout_s=agreement_timeout_s,
                      extra=dict(host_pool_pages=16, fault_copy_layer_delay_ms=layer_delay_ms, **settings))
    cuda = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else None
    async with LocalDomain(spec) as domain:
        loads = LayerLoads(GEOMETRY.layers, timeout_s=timeout_s, cuda_device=cuda, slots=4)
        with Client(domain.sockets[0], timeout_s=30) as client:
            attached = client.attach("orphans", GEOMETRY, PAGES, pool_fd=attach.get("pool_fd", -1),
                                     regions=attach.get("regions", ()), load_signals=loads.signals,
                                     cuda_events=loads.event_handles())
            loads.signals.close_fd()
            assert attached.host_pool_ticket, "the daemon offers its host pool (a memfd, pinned in place on CUDA)"
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
            first: tuple[int, int] | None = None
            for keys, target in halves:
                opened = session.load_opened(keys, target, loads.signals)
                assert opened is not None
                first = first or opened
                loads.opened(OpenLoad(*opened, tuple(session.host.slots(keys)), tuple(target)))
            loads.set_consumer(loads.start_batch())
            assert first is not None
            op, slot = first
            assert loads.signals.wait(slot, op, 1, time.monotonic() + 30)  # the first copy is under way
            fault(domain)
            for index in range(GEOMETRY.layers):
                loads.wait_until(index)
            if cuda is not None:
                torch.cuda.synchronize(cuda)  # the forward's stream, past every layer's wait
            exit_code = await domain.wait_exit(0, 30)
            daemon.close()
            return exit_code, [torch.equal(_rows(layer, TARGET), want) for layer, want in zip(layers, expected)]
