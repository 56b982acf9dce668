"""Run a `mooncake_master` (shipped in the Mooncake wheel) on loopback, for
the local launcher, the demo and the tests. Readiness is read from the
master's own log, not guessed with sleeps.

Every listener binds loopback: the master's RPC (`--rpc_address`), its
admin and metrics server (`--metrics_host`; every interface by default),
and the HTTP metadata server, which runs as a process of its own
(`mooncake.http_metadata_server --host`): the master's embedded one binds
every interface whatever `--http_metadata_server_host` says (Mooncake
0.3.13 builds its server without the host)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from cpcache.errors import Unavailable
from cpcache.testing.ports import free_port

READY_LINE = "Master admin server started"
HOST = "127.0.0.1"


def master_binary() -> str:
    beside_python = Path(sys.executable).with_name("mooncake_master")
    found = str(beside_python) if beside_python.exists() else shutil.which("mooncake_master")
    if not found:
        raise Unavailable("mooncake_master is not installed (pip install mooncake-transfer-engine-non-cuda)")
    return found


class MooncakeMaster:
    """Context manager: a master with an embedded HTTP metadata server."""

    def __init__(self, log_path: Path, start_timeout_s: float = 30.0) -> None:
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.metadata_proc: subprocess.Popen[bytes] | None = None
        self.rpc_port = self.http_port = self.metrics_port = 0

    @property
    def master(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{HOST}:{self.http_port}/metadata"

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def start(self) -> MooncakeMaster:
        """Start the master (stop it with `stop`), or raise Unavailable."""
        for _ in range(3):  # a port picked free may be taken before the master binds it
            if self._start():
                return self
        raise Unavailable(f"mooncake_master did not start; see {self.log_path}")

    def _start(self) -> bool:
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.metadata_proc = subprocess.Popen(
            [sys.executable, "-m", "mooncake.http_metadata_server", f"--host={HOST}", f"--port={self.http_port}",
             "--log-level=WARNING"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        threading.Thread(target=self._drain, args=(self.metadata_proc, threading.Event()), daemon=True).start()
        if not self._accepts(self.metadata_proc, self.http_port):
            self.stop()
            return False
        self.proc = subprocess.Popen(
            [master_binary(), f"--rpc_address={HOST}", f"--rpc_port={self.rpc_port}",
             "--enable_http_metadata_server=false", f"--metrics_host={HOST}", f"--metrics_port={self.metrics_port}",
             "--enable_metric_reporting=false", "--logtostderr=true"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        ready = threading.Event()
        threading.Thread(target=self._drain, args=(self.proc, ready), daemon=True).start()
        if ready.wait(self.start_timeout_s) and self._accepts(self.proc, self.rpc_port):
            return True
        self.stop()
        return False

    def pids(self) -> list[int]:
        """The processes serving the store: the master and its metadata server."""
        return [p.pid for p in (self.proc, self.metadata_proc) if p is not None]

    def metrics(self) -> dict[str, float]:
        """The master's own gauges and counters (its Prometheus endpoint):
        `master_allocated_bytes` is what the store holds now."""
        with urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        return {name: float(value) for name, value in
                (line.split() for line in text.splitlines() if line and not line.startswith("#") and
                 len(line.split()) == 2)}

    def _accepts(self, proc: subprocess.Popen[bytes], port: int) -> bool:
        """Until `port` takes a connection: the master prints its ready line
        before its RPC server listens, and a client's first connection in
        between is refused. False if `proc` exits or the time is up."""
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            try:
                socket.create_connection((HOST, port), 1.0).close()
                return True
            except OSError:
                try:  # the process's exit, or 50 ms: then try again
                    proc.wait(0.05)
                    return False
                except subprocess.TimeoutExpired:
                    pass
        return False

    def _drain(self, proc: subprocess.Popen[bytes], ready: threading.Event) -> None:
        """Copy the master's output to its log; flag the ready line."""
        output = proc.stdout
        assert output is not None  # started with stdout=PIPE
        with open(self.log_path, "ab") as log, output:
            for line in output:
                log.write(line)
                log.flush()
                if READY_LINE.encode() in line:
                    ready.set()
        ready.set()  # the master exited: stop waiting

    def stop(self) -> None:
        for proc in (self.proc, self.metadata_proc):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def __exit__(self, *exc: object) -> None:
        self.stop()
