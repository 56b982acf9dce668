"""Every listener flooded by a hostile local user (another uid,
in the socket's group, as docs/operations.md's recipe allows), then a real
scheduler attaches and steps in its usual time, while the daemon's
descriptors and threads, read from /proc all along, stay within the budget
docs/security.md states (`cpcache.daemon.budget`). Also what needs a real
daemon: pools it must refuse and socket_group."""

import asyncio
import collections
import contextlib
import fcntl
import grp
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cpcache import errors
from cpcache.client import AsyncClient, CacheRequests, WriteRequest
from cpcache.config import DaemonConfig
from cpcache.daemon import budget
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.daemon.server import ExitCode
from cpcache.dataplane.pools import DevicePool
from cpcache.geometry import KVGeometry
from cpcache.testing.ports import free_port
from cpcache.topology import Topology
from cpcache.v1 import daemon_pb2 as pb
from cpcache.v1 import daemon_pb2_grpc as pb_grpc
from cpcache.values import Reduce

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
GEOMETRY = KVGeometry(layers=2, kv_kind="mha", heads=1, head_dim=16, dtype="bfloat16", page_size=16)
NOBODY, NOGROUP = 65534, 65534
GROUP = "users"  # an existing group the hostile user is put in, as an operator would with socket_group
FLOOD = 3000  # connections per listener

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="switching to another uid needs root and setpriv")


def as_user(*command: str, groups: tuple[int, ...] = ()) -> list[str]:
    """`command` as nobody, with `groups` as its supplementary groups (an
    unprivileged user: no capabilities survive the uid change)."""
    group_flag = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOGROUP}", group_flag, *command]


class Hostile:
    """tests/daemon/hostile.py as nobody in GROUP, holding its connections until closed."""

    def __init__(self, mode: str, target: str, n: int) -> None:
        self.proc = subprocess.Popen(
            as_user("/usr/bin/python3", str(REPO / "tests" / "daemon" / "hostile.py"), mode, target, str(n),
                    groups=(grp.getgrnam(GROUP).gr_gid,)),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    async def report(self) -> dict:
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), 90)
        assert line, "the hostile process died"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)
        self.proc.stdout.close()


class Usage(threading.Thread):
    """The daemon's descriptors and threads, from /proc, every 20 ms: the
    highest seen."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.fds, self.threads = pid, 0, 0
        self.stopped = threading.Event()

    def sample(self) -> None:
        with open(f"/proc/{self.pid}/status") as status:
            threads = next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
        self.fds = max(self.fds, len(os.listdir(f"/proc/{self.pid}/fd")))
        self.threads = max(self.threads, threads)

    def run(self) -> None:
        while not self.stopped.wait(0.02):
            try:
                self.sample()
            except (OSError, StopIteration):
                return  # the daemon exited: the test says why

    def stop(self) -> tuple[int, int]:
        self.stopped.set()
        self.join(10)
        return self.fds, self.threads


@pytest.fixture
def shared_dir():
    """The run directory of docs/operations.md's recipe: the daemon's, entered by
    its socket group."""
    path = Path(tempfile.mkdtemp(prefix="cpc-shared-"))
    os.chown(path, -1, grp.getgrnam(GROUP).gr_gid)
    path.chmod(0o750)
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def attach_and_step(client: AsyncClient) -> float:
    """A real scheduler's first moments, on its channel that serves:
    attach, write a page, step until it is acknowledged. Returns the
    seconds taken."""
    started = time.monotonic()
    async with client:
        pool = DevicePool.create_sealed(GEOMETRY, 8)
        await client.attach("m", GEOMETRY, 8, pool_fd=pool.fd)
        reply = await client.step(1, requests=CacheRequests(writes=(WriteRequest(1, [bytes(32)], [0]),)))
        step = 1
        while 1 not in reply.write_acks:
            step += 1
            reply = await client.step(step)
    return time.monotonic() - started


@needs_root
@pytest.mark.parametrize(("listener", "n"), [
    ("grpc", FLOOD), ("grpc", budget.GRPC_CONNECTIONS + 1000), ("grpc-tcp", FLOOD), ("pools", FLOOD),
    ("metrics", FLOOD)])
async def test_a_flooded_listener_still_serves_within_budget(run_dir, shared_dir, listener, n):
    """A flood within the gRPC connection limit delays no one; one beyond
    it, until the handshake deadline has closed the idle connections."""
    token = run_dir / "token"
    token.write_text("s3cret-token-of-the-test\n")
    token.chmod(0o600)
    spec = DomainSpec(Topology(tp=1), run_dir, extra=dict(
        socket=str(shared_dir / "rank-{rank}.sock"), socket_group=GROUP, metrics_address="127.0.0.1:0",
        listen_tcp=f"127.0.0.1:{free_port()}", token_file=str(token), host_pool_pages=8))
    async with LocalDomain(spec) as domain:
        sock = domain.sockets[0]
        usage = Usage(domain.procs[0].pid)
        usage.sample()
        idle_fds, idle_threads = usage.fds, usage.threads
        usage.start()
        async with AsyncClient(sock) as client:
            metrics_port = (await client.status()).metrics_port
        target = {"grpc": sock, "grpc-tcp": spec.extra["listen_tcp"].rpartition(":")[2], "pools": sock + ".pools",
                  "metrics": str(metrics_port)}[listener]
        hostile = Hostile(listener, target, n)
        try:
            report = await hostile.report()
            flooded_at = time.monotonic()
            client = await connect(sock, within_s=30)
            took = await asyncio.wait_for(attach_and_step(client), 60)
            scraped = await asyncio.to_thread(scrape_time, metrics_port)
            since_flood = time.monotonic() - flooded_at
            rss_mib = rss_kib(domain.procs[0].pid) / 1024
        finally:
            hostile.close()
            fds, threads = usage.stop()
        print(f"\n{listener} x{n}: {report}; attach+step {took:.2f}s, a scrape {scraped:.2f}s, "
              f"{since_flood:.2f}s after the flood; daemon fds {idle_fds} idle, {fds} at most "
              f"(budget {budget.files(2)}); threads {idle_threads} idle, {threads} at most "
              f"(budget {budget.threads()}); RSS {rss_mib:.0f} MiB")
        assert report["uid"] == NOBODY
        assert fds <= budget.files(2) and threads <= budget.threads()
        assert took < 10.0 and scraped < 5.0
        within = n <= budget.GRPC_CONNECTIONS or not listener.startswith("grpc")
        assert since_flood < (10.0 if within else budget.GRPC_HANDSHAKE_S + 15.0)
        async with AsyncClient(sock) as client:
            assert (await client.status()).state == "serving"
            if listener == "pools":
                assert report["ticket"] <= budget.POOLS_TICKETS_PER_UID
                counted = await client.stats()
                assert 0 < counted["pool_handover_refused_tickets"] <= report["err"]
                assert counted["pool_tickets_held"] <= budget.POOLS_TICKETS_PER_UID


async def connect(sock: str, within_s: float) -> AsyncClient:
    """What a new scheduler does: open a channel and wait until it serves,
    opening another if the daemon closed this one (past the connection
    limit, a new connection is closed as it arrives). -> the client on the
    channel that serves, which the scheduler goes on with."""
    deadline = time.monotonic() + within_s
    while True:
        client = AsyncClient(sock)
        try:
            await client.wait_serving(max(0.5, deadline - time.monotonic()))
            return client
        except errors.Unavailable:
            await client.close()
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)  # a retry's back-off, as gRPC's own reconnects have


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def scrape_time(port: int) -> float:
    import urllib.request

    started = time.monotonic()
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    assert b"cpcache_build_info" in body
    return time.monotonic() - started


async def test_the_daemon_raises_its_descriptor_limit_to_the_budget(run_dir):
    """Started with systemd's default soft limit (1,024), the daemon holds
    the budget's descriptors anyway, as far as the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < budget.files(1):
        pytest.skip(f"the hard limit here ({hard}) is below the budget")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # inherited by the daemon
    try:
        domain = LocalDomain(DomainSpec(Topology(tp=1), run_dir))
        await domain.start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        with open(f"/proc/{domain.procs[0].pid}/limits") as limits:
            line = next(line for line in limits if line.startswith("Max open files"))
        assert int(line.split()[3]) == budget.files(1)
    finally:
        await domain.stop()


# -- pools the daemon must refuse, answered with a type ------------------------------------


@pytest.mark.parametrize("kind", ["hugetlb", "write-sealed"])
async def test_a_pool_the_kernel_does_not_guarantee_is_refused_with_a_type(run_dir, kind):
    """1: a hugetlb memfd passed every check and the daemon died of SIGBUS
    (exit -7) once its huge pages were gone; 8: a write-sealed memfd
    answered INTERNAL, "bug in Attach". Both now a typed refusal, and the
    daemon attaches a good pool next."""
    pages = (2 << 20) // GEOMETRY.page_bytes
    flags = os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if kind == "hugetlb" else 0)
    try:
        fd = os.memfd_create("hostile", flags)
    except OSError as exc:
        pytest.skip(f"no hugetlbfs memfd here: {exc}")
    os.ftruncate(fd, GEOMETRY.page_bytes * pages)
    seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | (fcntl.F_SEAL_WRITE if kind == "write-sealed" else 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir, extra=dict(host_pool_pages=8))) as domain:
        async with AsyncClient(domain.sockets[0]) as client:
            with pytest.raises(errors.FailedPrecondition,
                               match="hugetlbfs" if kind == "hugetlb" else "sealed against writing"):
                await client.attach("m", GEOMETRY, pages, pool_fd=fd)
            assert (await client.status()).state == "serving"
        assert await attach_and_step(AsyncClient(domain.sockets[0])) < 10.0
        assert domain.procs[0].poll() is None
        assert "bug in" not in domain.logs[0].read_text()
    os.close(fd)


# -- socket_group with the shipped unit -------------------------------------------------------


def unit_command(config: Path) -> list[str]:
    """The unit's ExecStart= for rank 0, run from this checkout with `config`."""
    unit = (REPO / "services" / "cpcached" / "cpcached@.service").read_text()
    line = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    words = line.removeprefix("ExecStart=").replace("%i", "0").split()
    words[0] = str(Path(sys.executable).with_name("cpcached"))
    return [str(config) if w == "/etc/cpcache/rank-0.toml" else w for w in words]


def rank_config(shared_dir: Path, port: int) -> Path:
    config = shared_dir / "rank-0.toml"
    config.write_text(f'socket = "{shared_dir}/rank-0.sock"\nsocket_group = "{GROUP}"\nhost_store = true\n'
                      f'rendezvous = "127.0.0.1:{port}"\ndeployment = "group-test"\n')
    config.chmod(0o644)
    return config


@needs_root
def test_socket_group_without_membership_exits_2_naming_the_setting(shared_dir):
    """It used to end in a traceback and exit 1 (so Restart=on-failure
    restarted it every 2 s), leaving a 0660 socket of the wrong group."""
    os.chown(shared_dir, NOBODY, -1)  # the daemon's own run directory
    result = subprocess.run(as_user(*unit_command(rank_config(shared_dir, free_port()))), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == ExitCode.CONFIG, result.stderr
    assert "setting socket_group" in result.stderr and f"Group={GROUP}" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(shared_dir.glob("*.sock*"))  # nothing bound


@needs_root
async def test_socket_group_recipe_serves_the_group(shared_dir):
    """The daemon (no capabilities) a member of the group, its run directory
    entered by the group (tests/operations/test_socket_group.py runs the
    unit's own settings with its drop-in)."""
    os.chown(shared_dir, NOBODY, -1)
    gid = grp.getgrnam(GROUP).gr_gid
    proc = subprocess.Popen(as_user(*unit_command(rank_config(shared_dir, free_port())), groups=(gid,)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        sock = str(shared_dir / "rank-0.sock")
        async with AsyncClient(sock) as client:
            await client.wait_serving(60)
        for path in (sock, sock + ".pools"):
            info = os.stat(path)
            assert (info.st_uid, info.st_gid, info.st_mode & 0o777) == (NOBODY, gid, 0o660)
        assert await attach_and_step(AsyncClient(sock)) < 10.0
    finally:
        proc.terminate()
        assert await asyncio.to_thread(proc.wait, 30) == ExitCode.STOPPED
        proc.stderr.close()


# -- a flood of calls on one connection costs the flooder's own calls ---------------------------


class StreamFlood:
    """One flooding client: streams on one connection (one channel), each
    read by a task; `refused` fires at its first refusal, `admitted` counts
    the Health.Watch streams the daemon took (they answer at once)."""

    def __init__(self, sock: str) -> None:
        self.channel = grpc.aio.insecure_channel("unix:" + sock)
        self.daemon = pb_grpc.CacheDaemonStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.calls: list = []
        self.tasks: list[asyncio.Task] = []
        self.errors: list[grpc.aio.AioRpcError] = []
        self.refused = asyncio.Event()
        self.watching = 0
        self.watch_errors: list[grpc.aio.AioRpcError] = []
        self.watched = asyncio.Condition()

    async def steps(self, n: int) -> None:
        """`n` Steps streams that never send a step."""
        await self.daemon.Status(pb.StatusRequest(), timeout=30)  # the connection is up, its limits known
        for _ in range(n):
            call = self.daemon.Steps()
            self.calls.append(call)
            self.tasks.append(asyncio.ensure_future(self._read(call)))

    async def watches(self, n: int, admitted: int) -> None:
        """`n` Health.Watch streams; returns once `admitted` of them answered.
        Those past its connection's limit wait in its transport, or are
        refused by the daemon's HTTP/2 (REFUSED_STREAM: UNAVAILABLE) when
        they reach it before the streams it ended are gone there: each of
        those is sent again, as a client would."""
        for _ in range(n):
            self._start_watch()
        failed = lambda: [e for e in self.watch_errors if e.code() != grpc.StatusCode.UNAVAILABLE]  # noqa: E731
        resent = 0
        async with self.watched:
            while self.watching < admitted and not failed():
                unavailable = sum(e.code() == grpc.StatusCode.UNAVAILABLE for e in self.watch_errors)
                for _ in range(unavailable - resent):
                    self._start_watch()
                resent = unavailable
                told = f"{self.watching} of {admitted} answered, {resent} refused" + \
                    (f" (last: {self.watch_errors[-1].details()})" if self.watch_errors else "")
                assert resent <= 10 * n, told
                try:
                    await asyncio.wait_for(self.watched.wait(), 60)
                except TimeoutError:
                    raise AssertionError(f"nothing answered nor refused in 60 s: {told}") from None
        assert not failed(), failed()[0]

    def _start_watch(self) -> None:
        call = self.health.Watch(health_pb2.HealthCheckRequest(service=""))
        self.calls.append(call)
        self.tasks.append(asyncio.ensure_future(self._watch(call)))

    async def _read(self, call) -> None:
        try:
            await call.read()
        except grpc.aio.AioRpcError as exc:
            self.errors.append(exc)
            self.refused.set()
            async with self.watched:
                self.watched.notify_all()

    async def refusals(self, n: int) -> None:
        """Until `n` Steps streams have ended."""
        async with self.watched:
            await asyncio.wait_for(self.watched.wait_for(lambda: len(self.errors) >= n), 60)

    async def _watch(self, call) -> None:
        try:
            await call.read()
        except grpc.aio.AioRpcError as exc:
            self.watch_errors.append(exc)
            async with self.watched:
                self.watched.notify_all()
            return
        async with self.watched:
            self.watching += 1
            self.watched.notify_all()

    async def first_refusal(self) -> grpc.aio.AioRpcError:
        await asyncio.wait_for(self.refused.wait(), 60)
        return self.errors[0]

    async def close(self) -> None:
        for call in self.calls:
            call.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.channel.close()


LIMITED = dict(host_pool_pages=8, max_concurrent_rpcs=128)
CONFIG = DaemonConfig(rank=0, **LIMITED)  # the shares these tests flood
FLOOD_STREAMS = CONFIG.max_concurrent_rpcs + CONFIG.control_rpcs + 8  # more than any share: today, all of them


@contextlib.asynccontextmanager
async def flooded(run_dir: Path, extra: dict | None = None):
    """A daemon whose one flooding client holds every Steps stream it can on
    one connection, until refused (today: every call slot). -> (domain, flood)."""
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir, extra=dict(LIMITED, **(extra or {})))) as domain:
        flood = StreamFlood(domain.sockets[0])
        try:
            await flood.steps(FLOOD_STREAMS)
            await flood.first_refusal()
            yield domain, flood
            async with AsyncClient(domain.sockets[0]) as client:  # the flood was held all along
                assert (await client.stats())["rpc_steps_streams_open"] == CONFIG.max_steps_streams
        finally:
            await flood.close()
        assert domain.procs[0].poll() is None
        async with AsyncClient(domain.sockets[0]) as client:
            assert (await client.status()).state == "serving"


async def test_a_flood_on_one_connection_leaves_health_status_and_outcome_answering(run_dir):
    """(a) Today one connection could hold every call slot with idle Steps
    streams, and Health, Status and Outcome answered RESOURCE_EXHAUSTED:
    a peer's recovery could not ask this daemon, a re-attach's health
    check failed. Now they answer on another connection, the flood held."""
    async with flooded(run_dir) as (domain, flood):
        async with AsyncClient(domain.sockets[0]) as other:
            assert await other.health() == health_pb2.HealthCheckResponse.SERVING
            assert (await other.status()).state == "serving"
            outcome = await other.outcome(0, 7)  # a step never taken here: its round cannot complete
            assert outcome.HasField("error")


async def test_a_flood_on_one_connection_leaves_a_schedulers_steps_answering(run_dir):
    """(b) A legitimate scheduler on its own connection attaches and steps
    while the flood is held: by Step, and by its Steps stream (the daemon
    has no stream to spare: the client steps by Step)."""
    async with flooded(run_dir) as (domain, flood):
        async with AsyncClient(domain.sockets[0]) as scheduler:
            pool = DevicePool.create_sealed(GEOMETRY, 8)
            await scheduler.attach("m", GEOMETRY, 8, pool_fd=pool.fd)
            reply = await scheduler.step(1, requests=CacheRequests(writes=(WriteRequest(1, [bytes(32)], [0]),)))
            stream = scheduler.steps_stream()
            step = 1
            while 1 not in reply.write_acks:
                step += 1
                reply = await stream.step(step)
            reply = await stream.step(step + 1, votes=[(9, Reduce.MAX, 4)])
            assert reply.decisions[9] == 4
            await stream.close()
            held = await scheduler.stats()
        assert held["rpc_steps_streams_open"] == CONFIG.max_steps_streams  # the flooder's, still held


async def test_a_flooder_is_refused_naming_the_setting_and_holds_one_connections_worth(run_dir):
    """(c) The flooder's streams past its share are refused
    RESOURCE_EXHAUSTED, naming the setting to raise; with other calls it
    holds at most `max_calls_per_connection` on its connection (those past
    it wait in its own transport)."""
    async with flooded(run_dir) as (domain, flood):
        refusal = flood.errors[0]
        assert refusal.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "setting max_steps_streams" in refusal.details(), refusal.details()
        # Past its share (RESOURCE_EXHAUSTED), or past its connection's limit, by
        # gRPC's HTTP/2 (REFUSED_STREAM: UNAVAILABLE): every stream past the share ends.
        await flood.refusals(FLOOD_STREAMS - CONFIG.max_steps_streams)
        await flood.watches(2 * CONFIG.max_calls_per_connection,
                            admitted=CONFIG.max_calls_per_connection - CONFIG.max_steps_streams)
        async with AsyncClient(domain.sockets[0]) as other:
            held = await other.stats()
        assert held["rpc_steps_streams_open"] == CONFIG.max_steps_streams
        assert held["rpc_calls_open"] == CONFIG.max_calls_per_connection + 1  # + that Stats
        # Those, and nothing else.
        codes = collections.Counter(e.code() for e in flood.errors)
        assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}, codes
        assert held["rpc_refused_max_steps_streams"] <= codes[grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert all("setting max_steps_streams" in e.details() for e in flood.errors
                   if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED)


async def test_an_idle_steps_stream_is_closed_and_its_slot_freed(run_dir):
    """(d) Steps streams that wait past `steps_idle_timeout_s` for a step are
    closed by the daemon, naming the setting; their slots serve the next
    streams."""
    extra = dict(LIMITED, steps_idle_timeout_s=1.0)
    config = DaemonConfig(rank=0, **extra)
    async with LocalDomain(DomainSpec(Topology(tp=1), run_dir, extra=extra)) as domain:
        sock = domain.sockets[0]
        flood = StreamFlood(sock)
        try:
            await flood.steps(config.max_steps_streams + 8)
            await asyncio.wait_for(asyncio.gather(*flood.tasks), 60)  # every stream ends: refused, or closed idle
            idle = [e for e in flood.errors if e.code() == grpc.StatusCode.UNAVAILABLE]
            assert len(idle) == config.max_steps_streams, [(e.code(), e.details()) for e in flood.errors]
            assert all("setting steps_idle_timeout_s" in e.details() for e in idle)
            async with AsyncClient(sock) as client:
                counts = await client.stats()
                assert counts["rpc_steps_streams_open"] == 0
                assert counts["rpc_steps_streams_closed_idle"] == config.max_steps_streams
                refused = counts["rpc_refused_max_steps_streams"]
                # The freed slots serve a scheduler's stream, step after step.
                stream = client.steps_stream()
                for step in (1, 2):
                    reply = await stream.step(step, votes=[(5, Reduce.MIN, 3)])
                    assert reply.decisions[5] == 3
                counts = await client.stats()
                assert counts["rpc_steps_streams_open"] == 1
                assert counts["rpc_refused_max_steps_streams"] == refused
                # The scheduler's own stream, idle in turn, is closed; its next
                # step goes on a new stream, as if nothing had happened.
                assert await asyncio.wait_for(stream._call.code(), 60) == grpc.StatusCode.UNAVAILABLE
                assert (await stream.step(3, votes=[(5, Reduce.MIN, 2)])).decisions[5] == 2
                counts = await client.stats()
                assert counts["rpc_steps_streams_closed_idle"] == config.max_steps_streams + 1
                assert counts["rpc_steps_streams_open"] == 1
                await stream.close()
        finally:
            await flood.close()
        assert domain.procs[0].poll() is None
