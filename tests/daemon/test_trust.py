"""Trust boundaries, tried on real daemons the way a hostile user
or a careless operator would: a planted run directory, TLS that names no
client, a rendezvous store reachable from other hosts, a second daemon on a
live socket, a hung store, too many calls, a model id that forges log lines."""

import asyncio
import fcntl
import os
import socket
import stat
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from cpcache import errors
from cpcache.client import AsyncClient, CacheRequests, WriteRequest
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.daemon.server import ExitCode
from cpcache.dataplane import memfd, regions
from cpcache.dataplane.pools import DevicePool
from cpcache.errors import InvalidArgument
from cpcache.geometry import KVGeometry, Region
from cpcache.testing.ports import free_port
from cpcache.topology import Topology
from cpcache.v1 import daemon_pb2 as pb
from cpcache.v1 import daemon_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(90)

GEOMETRY = KVGeometry(layers=2, kv_kind="mha", heads=1, head_dim=16, dtype="bfloat16", page_size=16)


def run_cpcached(*flags, timeout=30):
    return subprocess.run([sys.executable, "-m", "cpcache.daemon", *flags], capture_output=True, text=True,
                          timeout=timeout)


async def attach(client, run_dir, model_id="m"):
    pool = DevicePool.create_sealed(GEOMETRY, 8)
    return await client.attach(model_id, GEOMETRY, 8, pool_fd=pool.fd)


# -- the launcher's run directory ---------------------------------------------------


async def test_launch_refuses_a_planted_world_writable_run_dir(run_dir):
    victim = run_dir / "victim"
    victim.write_text("root's file\n")
    planted = run_dir / "shared"
    planted.mkdir()
    os.chmod(planted, 0o777)
    (planted / "rank-0.log").symlink_to(victim)
    with pytest.raises(InvalidArgument, match="group- or world-writable"):
        async with LocalDomain(DomainSpec(Topology(tp=1), planted)):
            pass
    assert victim.read_text() == "root's file\n"
    # The command an operator types says the same and starts nothing.
    result = subprocess.run([sys.executable, "-m", "cpcache.tools.cli", "launch", "--tp", "1", "--cp", "1",
                             "--run-dir", str(planted)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "world-writable" in result.stderr
    assert victim.read_text() == "root's file\n"


async def test_launch_never_follows_a_link_planted_as_a_log(run_dir):
    victim = run_dir / "victim"
    victim.write_text("root's file\n")
    private = run_dir / "private"
    private.mkdir(mode=0o700)
    (private / "rank-0.log").symlink_to(victim)
    with pytest.raises(OSError):  # O_NOFOLLOW: ELOOP
        async with LocalDomain(DomainSpec(Topology(tp=1), private)):
            pass
    assert victim.read_text() == "root's file\n"


async def test_launch_creates_its_run_dir_private(run_dir):
    fresh = run_dir / "fresh"
    async with LocalDomain(DomainSpec(Topology(tp=1), fresh)) as domain:
        assert stat.S_IMODE(os.lstat(fresh).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(domain.logs[0]).st_mode) == 0o600


# -- TCP authenticates its clients ------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate."""
    d = tmp_path_factory.mktemp("pki")

    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)

    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
            "-subj", "/CN=cpcache-test-ca", "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={name}",
                "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"))
        (d / f"{name}.ext").write_text(ext + "\n")
        openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
                "-CAcreateserial", "-days", "2", "-extfile", str(d / f"{name}.ext"), "-out", str(d / f"{name}.pem"))
    return d


@pytest.mark.parametrize("flags, words", [
    (["--listen-tcp", "127.0.0.1:0", "--tls-cert", "{pki}/server.pem", "--tls-key", "{pki}/server.key"],
     "setting listen_tcp: TLS alone authenticates no client"),
    (["--listen-tcp", "0.0.0.0:0", "--token-file", "{pki}/ca.pem"],
     "setting listen_tcp: a token over plaintext may only listen on loopback"),
    (["--tls-client-ca", "{pki}/ca.pem"], "setting tls_client_ca: needs tls_cert"),
])
def test_tcp_that_authenticates_no_one_exits_2_naming_the_setting(run_dir, pki, flags, words):
    flags = [f.format(pki=pki) for f in flags]
    result = run_cpcached("--rank", "0", "--socket", str(run_dir / "s.sock"), *flags)
    assert result.returncode == ExitCode.CONFIG, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr


async def test_mtls_refuses_a_client_holding_only_the_server_certificate(run_dir, pki):
    port = free_port()
    spec = DomainSpec(Topology(tp=1), run_dir, extra=dict(
        listen_tcp=f"127.0.0.1:{port}", tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.pem")))
    ca = (pki / "ca.pem").read_bytes()
    async with LocalDomain(spec):
        anonymous = grpc.ssl_channel_credentials(root_certificates=ca)  # what the attacker held
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", anonymous) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.CacheDaemonStub(channel).Status(pb.StatusRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        client_creds = grpc.ssl_channel_credentials(root_certificates=ca,
                                                    private_key=(pki / "client.key").read_bytes(),
                                                    certificate_chain=(pki / "client.pem").read_bytes())
        async with AsyncClient(f"127.0.0.1:{port}", credentials=client_creds) as client:
            assert (await client.status()).rank == 0


# -- the rendezvous store listens where it is told --------------------------------------


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket listening on `port`, from /proc."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as fh:
            next(fh)
            for line in fh:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # LISTEN
                    found.add(address)
    return found


async def test_a_daemon_hosting_the_store_listens_on_loopback_only(run_dir):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cpcache.daemon", "--rank", "0", "--host-store", "--rendezvous", f"127.0.0.1:{port}",
         "--socket", str(run_dir / "r.sock"), "--deployment", "loopback-test"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async with AsyncClient(str(run_dir / "r.sock")) as client:
            await client.wait_serving(60)
        # 127.0.0.1 in /proc's little-endian hex; nothing on 0.0.0.0 or ::.
        assert listening_addresses(port) == {"0100007F"}
    finally:
        proc.terminate()
        assert await asyncio.to_thread(proc.wait, 30) == ExitCode.STOPPED


# -- sockets are not taken over, nor deleted under a successor -------------------------------


async def test_a_second_daemon_refuses_a_live_socket_and_the_first_serves_on(run_dir):
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir)) as domain:
        result = run_cpcached("--rank", "0", "--socket", domain.sockets[0], "--rendezvous", "127.0.0.1:1",
                              "--rendezvous-timeout-s", "1")
        assert result.returncode == ExitCode.CONFIG, result.stderr
        assert "setting socket" in result.stderr and "served by a live daemon" in result.stderr
        async with AsyncClient(domain.sockets[0]) as client:
            assert (await client.status()).state == "serving"


def test_a_socket_path_naming_a_file_is_refused_and_the_file_kept(run_dir):
    path = run_dir / "not-a-socket"
    path.write_text("keep me\n")
    result = run_cpcached("--rank", "0", "--socket", str(path))
    assert result.returncode == ExitCode.CONFIG
    assert "is not a socket" in result.stderr and path.read_text() == "keep me\n"


async def test_a_stale_socket_is_replaced(run_dir):
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(run_dir / "rank-0.sock"))  # bound, never listened, then closed: nobody serves it
    stale.close()
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir)) as domain:
        async with AsyncClient(domain.sockets[0]) as client:
            assert (await client.status()).state == "serving"


async def test_a_stopping_daemon_unlinks_only_its_own_socket(run_dir):
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir)) as domain:
        path = domain.sockets[0]
        os.rename(path, path + ".moved")  # an operator moved it; a successor now serves the path
        successor = socket.socket(socket.AF_UNIX)
        successor.bind(path)
        successor.listen()
        identity = os.lstat(path).st_ino
        domain.signal(0, 15)
        assert await domain.wait_exit(0, timeout_s=30) == ExitCode.STOPPED
        assert os.lstat(path).st_ino == identity  # the successor's socket is still there
        successor.close()


# -- a hung store -------------------------------------------------------------------------


async def test_match_on_a_hung_store_answers_in_bounded_time_and_sigterm_finishes(run_dir):
    hung = dict(storage="file", storage_root=str(run_dir / "pages"), fault_storage_delay_ms=1e12,
                storage_timeout_s=0.5, host_pool_pages=8, io_threads=2)
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir, extra=hung)) as domain:
        async with AsyncClient(domain.sockets[0]) as client:
            await attach(client, run_dir)
            started = time.monotonic()
            outcomes = await asyncio.gather(*(client.match([bytes([i]) * 32]) for i in range(8)),
                                            return_exceptions=True)
            elapsed = time.monotonic() - started
            assert all(isinstance(o, errors.Unavailable) and "storage_timeout_s" in str(o) for o in outcomes)
            assert elapsed < 5.0, f"8 Matches on a hung store took {elapsed:.1f}s"
            assert (await client.status()).state == "serving"  # the loop is not blocked
        started = time.monotonic()
        domain.signal(0, 15)
        assert await domain.wait_exit(0, timeout_s=30) == ExitCode.STOPPED
        assert time.monotonic() - started < 15.0


# -- a limit on concurrent calls ---------------------------------------------------------------


async def test_calls_past_max_concurrent_rpcs_get_resource_exhausted(run_dir):
    """Past `max_concurrent_rpcs`, a call is refused naming the setting; Status
    still answers, from the `control_rpcs` no other call may take."""
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir, extra=dict(max_concurrent_rpcs=2))) as domain:
        async with grpc.aio.insecure_channel("unix:" + domain.sockets[0]) as channel:
            from grpc_health.v1 import health_pb2_grpc

            health = health_pb2_grpc.HealthStub(channel)
            watches = [health.Watch(health_pb2.HealthCheckRequest(service="")) for _ in range(2)]
            for watch in watches:  # both streams are open on the server now
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            stub = pb_grpc.CacheDaemonStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Stats(pb.StatsRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "setting max_concurrent_rpcs" in info.value.details()
            assert (await stub.Status(pb.StatusRequest(), timeout=10)).state == "serving"
            for watch in watches:
                watch.cancel()
        async with AsyncClient(domain.sockets[0]) as client:
            deadline = time.monotonic() + 10
            while True:  # the cancelled streams free their slots as the server sees them end
                try:
                    assert (await client.stats())["rpc_refused_max_concurrent_rpcs"] == 1
                    break
                except errors.ResourceExhausted:
                    assert time.monotonic() < deadline


# -- log fields cannot forge lines ----------------------------------------------------------------


async def test_a_model_id_with_a_newline_forges_no_log_line(run_dir):
    forged = "2099-01-01 00:00:00,000 rank0 cpcached INFO forged: attached /etc/shadow"
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir)) as domain:
        async with AsyncClient(domain.sockets[0]) as client:
            try:
                await attach(client, run_dir, model_id="m\n" + forged)
            except errors.InvalidArgument:
                pass  # refusing such an id outright is fine too
            await client.status()
        await domain.stop()
        lines = domain.logs[0].read_text().splitlines()
    assert not any(line.startswith("2099-01-01") for line in lines), lines


# -- the daemon opens no file a caller names; pools cannot shrink under it -------


async def test_a_pool_named_by_path_is_refused_and_the_file_untouched(run_dir):
    """A caller naming a file the daemon's user can write (here: a 0600 file
    the caller could not read if it were another user) gets
    PERMISSION_DENIED; the daemon never opens it."""
    victim = run_dir / "victim"
    victim.write_bytes(b"secret" * 1000)
    victim.chmod(0o600)
    before = victim.stat()
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir)) as domain:
        async with grpc.aio.insecure_channel("unix:" + domain.sockets[0]) as channel:
            request = pb.AttachRequest(model_id="m", device_pages=1, shm_path=str(victim), geometry=pb.Geometry(
                layers=1, kv_kind="mla", heads=1, head_dim=3000, dtype="uint8", page_size=2))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await pb_grpc.CacheDaemonStub(channel).Attach(request)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "opens no file a caller names" in info.value.details()
        async with AsyncClient(domain.sockets[0]) as client:
            assert (await client.status()).state == "serving" and not (await client.status()).attached
    after = victim.stat()
    assert (after.st_atime_ns, after.st_mtime_ns, after.st_size) == (before.st_atime_ns, before.st_mtime_ns,
                                                                   before.st_size)


async def test_a_pool_that_could_shrink_is_refused_and_a_sealed_one_cannot(run_dir):
    """A plain file handed over by descriptor could be truncated under the
    daemon's mapping (SIGBUS): refused. A sealed memfd cannot shrink, even by
    its creator, so the daemon lives on whatever the scheduler does."""
    plain = run_dir / "plain-pool"
    plain.write_bytes(bytes(GEOMETRY.page_bytes * 8))
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir)) as domain:
        async with AsyncClient(domain.sockets[0]) as client:
            fd = os.open(plain, os.O_RDWR)
            try:
                with pytest.raises(errors.FailedPrecondition, match="shmem memfd|sealed against shrinking"):
                    await client.attach("m", GEOMETRY, 8, pool_fd=fd)
            finally:
                os.close(fd)
            pool = DevicePool.create_sealed(GEOMETRY, 8)
            await client.attach("m", GEOMETRY, 8, pool_fd=pool.fd)
            with pytest.raises(PermissionError):
                os.ftruncate(pool.fd, 0)  # what a restarting scheduler re-creating its pool would do
            reply = await client.step(1, requests=CacheRequests(writes=(WriteRequest(1, [bytes(32)], [0]),)))
            step = 1
            while 1 not in reply.write_acks:
                step += 1
                reply = await client.step(step)
            assert (await client.status()).state == "serving"


async def test_a_pool_truncated_then_sealed_is_a_typed_refusal_and_the_daemon_serves_on(run_dir):
    """On a real daemon: the pool as a creator leaves it after
    truncating it below its pages and then sealing it. The seals are read
    before the size, so the size the daemon checks is the size for good:
    INVALID_ARGUMENT naming both sizes, never INTERNAL, and a good pool
    attaches afterwards (the race itself is driven in test_pool_kinds)."""
    fd = os.memfd_create("shrunk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, GEOMETRY.page_bytes * 8)
        os.ftruncate(fd, GEOMETRY.page_bytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, memfd.REQUIRED_SEALS)
        async with LocalDomain(DomainSpec(Topology(tp=1), run_dir)) as domain:
            async with AsyncClient(domain.sockets[0]) as client:
                with pytest.raises(InvalidArgument, match="need .* bytes, but the pool holds"):
                    await client.attach("m", GEOMETRY, 8, pool_fd=fd)
                assert (await client.status()).state == "serving"
                pool = DevicePool.create_sealed(GEOMETRY, 8)
                await client.attach("m", GEOMETRY, 8, pool_fd=pool.fd)
                assert (await client.status()).attached
    finally:
        os.close(fd)


async def test_regions_a_daemon_must_not_map_are_typed_refusals_and_good_ones_attach(run_dir):
    """A region per layer over a real daemon: a count other than the
    layers', a region past the memfd, two layers over the same bytes, CUDA
    handles in some regions only: each a typed refusal (nothing mapped, the
    daemon serves on); the layers in another order in memory attach."""
    pool = DevicePool.create_sealed(GEOMETRY, 8)
    good = regions.contiguous(GEOMETRY, 8)
    refused = [
        (good[:1], InvalidArgument, "1 regions for 2 layers"),
        ([good[0], Region(good[1].offset + 2, good[1].strides)], InvalidArgument, "past the"),
        ([good[0], good[0]], errors.FailedPrecondition, "overlap"),
        ([Region(0, good[0].strides, {"device": 0}), good[1]], InvalidArgument, "in every region or in none"),
    ]
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir)) as domain:
        async with AsyncClient(domain.sockets[0]) as client:
            for bad, error, words in refused:
                with pytest.raises(error, match=words):
                    await client.attach("m", GEOMETRY, 8, pool_fd=pool.fd, regions=bad)
                assert (await client.status()).state == "serving"
            await client.attach("m", GEOMETRY, 8, pool_fd=pool.fd, regions=list(reversed(good)))
            assert (await client.status()).attached


async def test_a_pool_ticket_is_good_once_and_only_on_its_daemon(run_dir):
    from cpcache.client.pools import hand_over

    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir)) as domain:
        pool = DevicePool.create_sealed(GEOMETRY, 8)
        ticket = hand_over(domain.sockets[0], pool.fd)
        async with grpc.aio.insecure_channel("unix:" + domain.sockets[0]) as channel:
            stub = pb_grpc.CacheDaemonStub(channel)
            request = pb.AttachRequest(model_id="m", device_pages=8, shm_ticket="0" * 32, geometry=pb.Geometry(
                layers=GEOMETRY.layers, kv_kind=GEOMETRY.kv_kind, heads=GEOMETRY.heads,
                head_dim=GEOMETRY.head_dim, dtype=GEOMETRY.dtype, page_size=GEOMETRY.page_size))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Attach(request)  # a guessed ticket
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            request.shm_ticket = ticket
            await stub.Attach(request)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Attach(request)  # the same ticket again
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        mode = os.stat(domain.sockets[0] + ".pools").st_mode & 0o777
        assert mode == 0o600  # as private as the daemon's own socket
