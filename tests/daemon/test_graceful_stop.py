"""Graceful means graceful (docs/design.md rule 12): a daemon told to stop (SIGTERM:
systemd's stop or restart, an upgrade, an operator's `kill -TERM`) while an
overlapped load-back is open finishes every copy it has issued, queued ones
included, publishing each layer on the scheduler's board, and then exits 0:
the forward reading the load reads it whole, and never LoadBackFailed."""

import signal
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cpcache.client import Client, SchedulerSession
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.dataplane.pools import DevicePool
from cpcache.geometry import KVGeometry
from cpcache.keys import chain
from cpcache.load_signals import LoadSignals
from cpcache.topology import Topology

pytestmark = pytest.mark.timeout(90)

LAYERS = 4
PAGE = 4  # tokens per page
GEOMETRY = KVGeometry(layers=LAYERS, kv_kind="mha", heads=2, head_dim=16, dtype="float16", page_size=PAGE)
DEVICE_PAGES = 16
SOURCE, TARGETS = [0, 1], ([8, 9], [12, 13])


def _rows(pool: DevicePool, pages: list[int]) -> torch.Tensor:
    return pool.tensor[:, :, pages[0] * PAGE : (pages[-1] + 1) * PAGE].view(torch.int16)


async def test_sigterm_finishes_the_open_load_backs_then_exits(run_dir):
    # One copy thread per lane, each layer of a load-back 150 ms late: the
    # second load is still queued behind the first when the signal comes.
    spec = DomainSpec(Topology(tp=1), run_dir,
                      extra=dict(host_pool_pages=16, io_threads=1, fault_copy_layer_delay_ms=150.0))
    async with LocalDomain(spec) as domain:
        pool = DevicePool.create_sealed(GEOMETRY, DEVICE_PAGES)
        pool.tensor.view(torch.int16).random_()
        board = LoadSignals.create(4)
        with Client(domain.sockets[0], timeout_s=20) as client:
            seed = client.attach("m", GEOMETRY, DEVICE_PAGES, pool_fd=pool.fd, load_signals=board).key_seed
            pages = [bytes.fromhex(h) for h in chain(list(range(len(SOURCE) * PAGE)), PAGE, seed)]
            session = SchedulerSession(client)
            written: list[bool] = []
            session.write_through(pages, SOURCE, done=written.append)
            while not written:
                session.flush()
            assert written == [True]
            expected = _rows(pool, SOURCE).clone()
            for target in TARGETS:
                _rows(pool, target).zero_()
            # Each call returns once its round has opened the load: its copy issued.
            opened = [session.load_opened(pages, target, board) for target in TARGETS]
            loads = [load for load in opened if load is not None]
            assert len(loads) == len(TARGETS), opened
            domain.signal(0, signal.SIGTERM)
            # Every layer of both loads is published as copied, never FAILED
            # (the old shutdown cancelled the queued copy and published it so).
            for op, slot in loads:
                assert board.wait(slot, op, LAYERS, time.monotonic() + 30), (op, board.progress(slot, op))
            for target in TARGETS:
                assert torch.equal(_rows(pool, target), expected), target
            assert await domain.wait_exit(0, 60) == 0
    assert "copies between device and host issued before the stop" in domain.log_tail(0, lines=200)


async def test_a_graceful_restart_ends_the_watches_and_the_next_attach_keeps_a_new_one(run_dir):
    """A blocking client that steps keeps a health Watch open (it keeps the
    channel's event thread), and never reads it. The draining daemon tells
    its Watches NOT_SERVING and ends them (rather than leaving the server's
    stop to cancel them after its grace), and exits 0; once it is back, the
    client's next attach drops the old Watch, whose end it never saw, and
    its next step opens one on the daemon that came back."""
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir, extra=dict(host_pool_pages=4))) as domain:
        pool = DevicePool.create_sealed(GEOMETRY, DEVICE_PAGES)
        with Client(domain.sockets[0], timeout_s=20) as client:
            client.attach("m", GEOMETRY, DEVICE_PAGES, pool_fd=pool.fd)
            SchedulerSession(client).flush()
            kept = client._event_keeper
            assert kept is not None and not kept.done()
            request = health_pb2.HealthCheckRequest(service="")
            with grpc.insecure_channel(f"unix:{domain.sockets[0]}") as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(request)
                assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
                domain.signal(0, signal.SIGTERM)
                assert [reply.status for reply in watch] == [health_pb2.HealthCheckResponse.NOT_SERVING]
                assert watch.code() == grpc.StatusCode.OK, (watch.code(), watch.details())
            assert await domain.wait_exit(0, 60) == 0
            await domain.restart(0, 60)
            client.attach("m", GEOMETRY, DEVICE_PAGES, pool_fd=pool.fd)
            SchedulerSession(client).flush()
            assert client._event_keeper is not kept and not client._event_keeper.done()
            assert client.stats()["rpc_calls_open"] == 2  # the new Watch, and this Stats
