"""One daemon's lifecycle and its answers to bad input, over its real unix
socket."""

import asyncio
import os
import stat
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2

from cpcache import errors
from cpcache.client import AsyncClient, messages
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.daemon.server import ExitCode
from cpcache.testing.ports import free_port
from cpcache.topology import Topology
from cpcache.v1 import daemon_pb2 as pb
from cpcache.v1 import daemon_pb2_grpc as pb_grpc
from cpcache.values import Reduce

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def single(run_dir):
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir)) as domain:
        yield domain


async def test_status_says_the_release_and_cpcache_status_shows_it(single, capsys):
    import argparse
    import json

    import cpcache
    from cpcache.tools import cli

    async with AsyncClient(single.sockets[0]) as client:
        assert (await client.status()).version == cpcache.__version__
    args = argparse.Namespace(command="status", socket=str(single.sockets[0]), timeout=5.0)
    assert await cli._status(args) == 0
    assert json.loads(capsys.readouterr().out)["version"] == cpcache.__version__


async def test_socket_is_private_to_its_owner(single):
    mode = stat.S_IMODE(os.stat(single.sockets[0]).st_mode)
    assert mode == 0o600


async def test_a_socket_group_socket_is_born_group_writable_and_owned_by_the_group(run_dir):
    import grp

    group = grp.getgrgid(os.getgid()).gr_name
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir, extra=dict(socket_group=group))) as domain:
        info = os.stat(domain.sockets[0])
        assert stat.S_IMODE(info.st_mode) == 0o660 and info.st_gid == os.getgid()


BAD_REQUESTS = [
    (pb.StepRequest(step=0), grpc.StatusCode.INVALID_ARGUMENT, "outside [1, 2**63)"),
    (pb.StepRequest(step=2**63), grpc.StatusCode.INVALID_ARGUMENT, "outside [1, 2**63)"),
    (pb.StepRequest(step=5, votes=pb.Votes(op_ids=[1, 2], reduces=[pb.REDUCE_MIN], values=[1, 2])),
     grpc.StatusCode.INVALID_ARGUMENT, "equal lengths"),
    (pb.StepRequest(step=5, votes=pb.Votes(op_ids=[1], reduces=[pb.REDUCE_UNSPECIFIED], values=[1])),
     grpc.StatusCode.INVALID_ARGUMENT, "no valid reduce"),
    (pb.StepRequest(step=5, votes=pb.Votes(op_ids=[1, 1], reduces=[pb.REDUCE_MIN] * 2, values=[1, 2])),
     grpc.StatusCode.INVALID_ARGUMENT, "appears twice"),
    (pb.StepRequest(step=5, votes=pb.Votes(op_ids=[2**63], reduces=[pb.REDUCE_MIN], values=[1])),
     grpc.StatusCode.INVALID_ARGUMENT, "outside"),
    (pb.StepRequest(step=5, votes=pb.Votes(op_ids=[1], reduces=[pb.REDUCE_MIN], values=[-(2**63)])),
     grpc.StatusCode.INVALID_ARGUMENT, "int64 range"),
    (pb.StepRequest(step=3), grpc.StatusCode.FAILED_PRECONDITION, "already taken with different content"),
    (pb.StepRequest(step=2), grpc.StatusCode.FAILED_PRECONDITION, "not after the last step 3"),
]


@pytest.mark.parametrize("request_, code, words", BAD_REQUESTS, ids=[w for _, _, w in BAD_REQUESTS])
async def test_bad_input_gets_its_status_and_changes_nothing(single, request_, code, words):
    async with AsyncClient(single.sockets[0]) as client:
        before = await client.step(3, [(1, Reduce.MIN, 4)])
        async with grpc.aio.insecure_channel("unix:" + single.sockets[0]) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.CacheDaemonStub(channel).Step(request_)
        assert info.value.code() == code
        assert words in info.value.details()
        status = await client.status()
        # A readable step number is taken (its round ran, rejected); nothing else changed.
        assert status.last_step == (5 if request_.step == 5 else 3) and status.open_questions == 0
        after = await client.step(6, [(1, Reduce.MIN, 4)])
        assert after.decisions == before.decisions == {1: 4}
        assert (await client.step(3, [(1, Reduce.MIN, 4)])).wire == before.wire  # a retry: the same bytes


async def test_sigterm_drains_in_flight_calls_and_refuses_new_ones(run_dir):
    async with LocalDomain(DomainSpec(Topology(tp=2), run_dir)) as domain:
        a, b = AsyncClient(domain.sockets[0]), AsyncClient(domain.sockets[1])
        in_flight = asyncio.ensure_future(a.step(1, [(1, Reduce.MIN, 10)]))
        while (await a.status()).last_step < 1:  # the step has reached rank 0
            await asyncio.sleep(0)
        watch = a._health.Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        domain.signal(0, 15)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(errors.Unavailable, match="draining"):
            await a.step(2, [])
        # Rank 1 joins the round: rank 0's in-flight call completes, then it exits.
        reply_b = await b.step(1, [(1, Reduce.MIN, 3)])
        reply_a = await in_flight
        assert reply_a.wire == reply_b.wire and reply_a.decisions == {1: 3}
        assert await domain.wait_exit(0, timeout_s=10) == ExitCode.STOPPED
        assert not os.path.exists(domain.sockets[0])
        for c in (a, b):
            await c.close()


def run_cpcached(*flags, env=None):
    return subprocess.run(
        [sys.executable, "-m", "cpcache.daemon", *flags],
        capture_output=True, text=True, timeout=30, env=env,
    )


def test_tcp_without_token_or_tls_is_refused_at_start(run_dir):
    result = run_cpcached("--rank", "0", "--socket", str(run_dir / "s.sock"), "--listen-tcp", "127.0.0.1:0")
    assert result.returncode == ExitCode.CONFIG
    assert "setting listen_tcp" in result.stderr and "token_file" in result.stderr


@pytest.mark.parametrize("flags, words", [
    (["--socket-group", "no-such-group-here"], "setting socket_group: no group named 'no-such-group-here'"),
    (["--listen-tcp", "127.0.0.1:0", "--token-file", "/nonexistent/token"], "setting token_file: cannot read"),
    (["--listen-tcp", "127.0.0.1:0", "--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"],
     "setting tls_cert: cannot read"),
])
def test_unusable_listener_files_and_groups_exit_2_naming_the_setting(run_dir, flags, words):
    result = run_cpcached("--rank", "0", "--socket", str(run_dir / "s.sock"), *flags)
    assert result.returncode == ExitCode.CONFIG, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr


def test_bad_setting_is_named(run_dir):
    result = run_cpcached("--rank", "0", "--tp", "8", "--cp", "3")
    assert result.returncode == ExitCode.CONFIG
    assert "tp=8" in result.stderr and "dp*cp=1*3" in result.stderr
    result = run_cpcached("--rank", "0", "--agreement-timeout-s", "soon")
    assert "setting agreement_timeout_s from --agreement-timeout-s: 'soon' is not a valid float" in result.stderr


async def test_tcp_listener_requires_the_token(run_dir):
    token_file = run_dir / "token"
    token_file.write_text("s3cret\n")
    port = free_port()
    spec = DomainSpec(Topology(tp=1), run_dir, extra=dict(listen_tcp=f"127.0.0.1:{port}", token_file=str(token_file)))
    async with LocalDomain(spec):
        async with AsyncClient(f"127.0.0.1:{port}") as anonymous:
            with pytest.raises(errors.CacheError, match="UNAUTHENTICATED"):
                await anonymous.step(1, [])
        async with AsyncClient(f"127.0.0.1:{port}", token="s3cret") as client:
            assert (await client.step(1, [(9, Reduce.MAX, 2)])).decisions == {9: 2}


async def test_a_second_signal_cuts_the_drain_short(run_dir):
    spec = DomainSpec(Topology(tp=2), run_dir, agreement_timeout_s=30.0)
    async with LocalDomain(spec) as domain:
        a = AsyncClient(domain.sockets[0])
        in_flight = asyncio.ensure_future(a.step(1, []))  # rank 1 never joins: the drain would wait
        while (await a.status()).last_step < 1:
            await asyncio.sleep(0)
        watch = a._health.Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        domain.signal(0, 15)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        domain.signal(0, 15)
        assert await domain.wait_exit(0, timeout_s=10) == ExitCode.FORCED
        with pytest.raises(errors.CacheError):
            await in_flight
        await a.close()


async def test_a_long_prompt_fits_a_step_and_an_oversized_request_is_invalid_argument(run_dir):
    """A 128k-token prefetch at page size 1 (4.5 MB of hashes, past gRPC's
    default 4 MiB) is an ordinary step; past the message limit the client
    refuses to send, and the daemon answers INVALID_ARGUMENT, not the
    RESOURCE_EXHAUSTED that means "pool full"."""
    from cpcache.client import CacheRequests, PrefetchRequest
    from cpcache.dataplane.pools import DevicePool
    from cpcache.geometry import KVGeometry
    from cpcache.values import MAX_MESSAGE_BYTES

    geometry = KVGeometry(layers=1, kv_kind="mla", heads=1, head_dim=8, dtype="float16", page_size=1)
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir, extra=dict(storage="file",
                                                                         storage_root=str(run_dir / "pages"),
                                                                         host_pool_pages=64))) as domain:
        pool = DevicePool.create_sealed(geometry, 16)
        async with AsyncClient(domain.sockets[0]) as client:
            await client.attach("long", geometry, 16, pool_fd=pool.fd)
            pages = [i.to_bytes(32, "little") for i in range(128 * 1024)]
            reply = await client.step(1, requests=CacheRequests(prefetches=(PrefetchRequest(1, pages, len(pages)),)))
            assert reply.step == 1
            huge = CacheRequests(prefetches=tuple(PrefetchRequest(op, pages, len(pages)) for op in range(2, 20)))
            with pytest.raises(errors.InvalidArgument, match="split it over several steps"):
                await client.step(2, requests=huge)
            request = messages.step_request(2, requests=huge)
            assert MAX_MESSAGE_BYTES < request.ByteSize() < 2 * MAX_MESSAGE_BYTES
            async with grpc.aio.insecure_channel("unix:" + domain.sockets[0],
                                                 options=[("grpc.max_send_message_length", -1)]) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await pb_grpc.CacheDaemonStub(channel).Step(request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "split it over several steps" in info.value.details()
            assert (await client.status()).state == "serving"


def test_a_drain_shorter_than_a_step_round_is_refused_at_start(run_dir):
    """A drain that cannot outlast a step's round in flight would stop
    answering while a late peer may still complete it (two ranks, two
    outcomes): refused, naming both settings and the least it may be."""
    result = run_cpcached("--rank", "0", "--socket", str(run_dir / "s.sock"), "--agreement-timeout-s", "10",
                          "--drain-timeout-s", "2")
    assert result.returncode == ExitCode.CONFIG, result.stderr
    assert "setting drain_timeout_s" in result.stderr and "at least 16 s: agreement_timeout_s (10)" in result.stderr
    assert "Traceback" not in result.stderr
