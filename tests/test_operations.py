"""Operating cpcached: the systemd unit, sd_notify over a real datagram
socket, compose.yaml against the compose spec, and metrics over HTTP."""

import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from cpcache import errors
from cpcache.client import AsyncClient, Ops
from cpcache.dataplane.pools import DevicePool
from cpcache.geometry import KVGeometry
from cpcache.tools.launcher import DomainSpec, LocalDomain
from cpcache.topology import Topology

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(60)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_unit_verifies(tmp_path):
    unit = (REPO / "services" / "cpcached" / "cpcached@.service").read_text()
    # verify checks that ExecStart exists: point it at this checkout's daemon
    unit = unit.replace("/opt/cpcache/.venv/bin/cpcached", str(Path(sys.executable).with_name("cpcached")))
    instance = tmp_path / "cpcached@0.service"
    instance.write_text(unit)
    result = subprocess.run(["systemd-analyze", "verify", str(instance)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "Type=notify" in unit and "WatchdogSec=" in unit and "/etc/cpcache/rank-%i.toml" in unit


def test_compose_file_follows_the_compose_spec():
    checker = shutil.which("check-jsonschema") or str(Path(sys.executable).with_name("check-jsonschema"))
    result = subprocess.run([checker, "--builtin-schema", "vendor.compose-spec", str(REPO / "compose.yaml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_daemon_notifies_ready_then_stopping(run_dir):
    notify = run_dir / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    sock.settimeout(30)  # recv waits for the daemon's datagram; the timeout only bounds a failure
    store = __import__("cpcache.agreement.collective", fromlist=["host_store"]).host_store()
    with open(run_dir / "daemon.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cpcache.daemon", "--rank", "0", "--socket", str(run_dir / "d.sock"),
             "--rendezvous", f"127.0.0.1:{store.port}"],
            env={"NOTIFY_SOCKET": str(notify), "WATCHDOG_USEC": "2000000", "PATH": "/usr/bin:/bin"},
            stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        messages = []
        while not any("READY=1" in m for m in messages):
            messages.append(sock.recv(4096).decode())
        ready = next(m for m in messages if "READY=1" in m)
        assert "STATUS=serving rank 0" in ready
        proc.send_signal(signal.SIGTERM)
        while not any("STOPPING=1" in m for m in messages):
            messages.append(sock.recv(4096).decode())
        assert "WATCHDOG=1" in messages  # the first ping goes out as the daemon starts
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        sock.close()


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def test_metrics_move_while_the_cache_works(run_dir):
    geometry = KVGeometry(layers=1, kv_kind="mla", heads=1, head_dim=32, dtype="float16", page_size=16)
    spec = DomainSpec(Topology(tp=1), run_dir, extra=dict(metrics_address="127.0.0.1:0", host_pool_pages=8))
    async with LocalDomain(spec) as domain:
        async with AsyncClient(domain.sockets[0]) as client:
            port = (await client.status()).metrics_port
            assert port
            before = scrape(port)
            path = str(run_dir / "pool")
            DevicePool.create_shared_file(path, geometry, 8)
            await client.attach("m", geometry, 8, shm_path=path)
            pages = [bytes([i]) * 32 for i in range(3)]
            await client.step(1, ops=Ops(writes=((1, pages, [0, 1, 2]),)))
            step = 1
            while True:  # steps until the write-through is agreed done
                step += 1
                if 1 in (await client.step(step)).write_acks:
                    break
            await client.step(step + 1, ops=Ops(loads=((2, pages, [3, 4, 5]),)))
            with pytest.raises(errors.FailedPrecondition):
                await client.step(1)  # an old step with other content: counted as FAILED_PRECONDITION
            after = scrape(port)
    rank = '{rank="0"}'
    assert after[f"cpcache_rounds_total{rank}"] > before.get(f"cpcache_rounds_total{rank}", 0)
    assert after['cpcache_pages_moved_total{mover="device->host",rank="0"}'] == 3
    assert after['cpcache_hit_pages_total{rank="0",tier="host"}'] == 3
    assert after['cpcache_rpcs_total{code="OK",method="Step",rank="0"}'] >= step
    assert after['cpcache_rpcs_total{code="FAILED_PRECONDITION",method="Step",rank="0"}'] == 1
    assert after['cpcache_round_seconds_count{rank="0"}'] >= step
    assert after['cpcache_host_pages{rank="0",state="used"}'] == 3
