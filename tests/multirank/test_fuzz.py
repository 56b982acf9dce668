"""`cpcache fuzz`, short: hostile requests of every CacheDaemon RPC against a
live two-rank domain. Nothing but documented statuses answers, every step is
accepted or refused alike on both ranks, the cache digest agrees and a
refused step leaves it alone, and the daemons serve on.

The bugs the fuzz found have each a regression test below."""

import grpc
import pytest

from cpcache.client.wire_errors import error_info
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.testing import fuzz
from cpcache.topology import Topology
from cpcache.v1 import daemon_pb2 as pb

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(120)]


async def test_hostile_requests_get_documented_answers_and_the_domain_stays_sound(run_dir):
    report = await fuzz.fuzz(per_rpc=150, seed=7, run_dir=run_dir)
    assert report.violations == [], report.violations[:5]
    for rpc in fuzz.RPCS:
        assert report.sent[rpc] >= 150, (rpc, report.sent[rpc])
        assert report.raw_sent[rpc] > 0, rpc
    assert report.accepted_rounds > 0 and report.rejected_rounds > 0
    assert report.statuses["Stats"]["OK"] > 0 and report.statuses["Step"]["INVALID_ARGUMENT"] > 0


async def call(socket, rpc, data):
    async with grpc.aio.insecure_channel("unix:" + socket) as channel:
        method = channel.unary_unary(fuzz.SERVICE + rpc, request_serializer=None, response_deserializer=None)
        try:
            await method(data, timeout=10)
        except grpc.aio.AioRpcError as exc:
            info = error_info(exc)
            return exc.code().name, exc.details(), info.reason if info else ""
        return "OK", "", ""


def spec(run_dir):
    return DomainSpec(Topology(tp=2), run_dir, agreement_timeout_s=5.0)


def attach_request(**pool):
    g = fuzz.GEOMETRY
    return pb.AttachRequest(model_id="m", device_pages=8, geometry=pb.Geometry(
        layers=g.layers, kv_kind=g.kv_kind, heads=g.heads, head_dim=g.head_dim, dtype=g.dtype,
        page_size=g.page_size), **pool).SerializeToString()


async def test_an_undecodable_request_body_answers_a_documented_status(run_dir):
    async with LocalDomain(spec(run_dir)) as domain:
        code, details, _ = await call(domain.sockets[0], "Stats", b"\xff")
        assert code not in ("UNKNOWN", "INTERNAL"), (code, details)


async def test_attach_with_a_cuda_handle_on_a_host_without_cuda_answers_a_documented_status(run_dir):
    async with LocalDomain(spec(run_dir)) as domain:
        request = attach_request(cuda_ipc=pb.CudaIpcHandle(device=0, handle=b"x" * 64, storage_size=16384))
        code, details, _ = await call(domain.sockets[0], "Attach", request)
        assert code in fuzz.DOCUMENTED - {"OK"}, (code, details)


async def test_attach_with_a_nul_byte_in_the_pool_path_answers_a_documented_status(run_dir):
    async with LocalDomain(spec(run_dir)) as domain:
        code, details, _ = await call(domain.sockets[0], "Attach", attach_request(shm_path=str(run_dir / "a\x00b")))
        assert code in fuzz.DOCUMENTED - {"OK"}, (code, details)
