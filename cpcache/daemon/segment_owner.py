"""The memory of a Mooncake Store, held by a process that outlives daemons.

A Mooncake client that mounts a segment lends the store its memory: every
object placed in that segment lives only while the client does. When a
daemon mounts one and dies, the master expires its lease and unmounts the
segment, and every page in it leaves the store; the writes of the peers that
placed pages there fail (`TRANSFER_FAIL` to the dead daemon's port). So the
daemons mount nothing (`storage_segment_bytes = 0`: they only put and get)
and one segment owner per host holds the memory: Mooncake's own real client
(`mooncake_client`, shipped in its wheel), which `cpcache launch` keeps for
as long as it runs and `cpcache segment-owner` runs as a service of its own
(docs/operations.md). A daemon killed, restarted or stopped leaves the store
as it was, and a re-formed domain starts warm from it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from cpcache.config import DaemonConfig
from cpcache.errors import Unavailable

READY_LINE = "Starting real client service"


def owner_binary() -> str:
    beside_python = Path(sys.executable).with_name("mooncake_client")
    found = str(beside_python) if beside_python.exists() else shutil.which("mooncake_client")
    if not found:
        raise Unavailable("mooncake_client is not installed (pip install mooncake-transfer-engine-non-cuda, or "
                          "mooncake-transfer-engine on CUDA hosts)")
    return found


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host if host else "127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class OwnerSettings:
    """Where the store is and what this host lends it (the daemons' storage settings)."""

    master: str
    metadata_server: str
    hostname: str  # the address peers reach the segment at
    protocol: str
    device: str
    segment_bytes: int

    @classmethod
    def of(cls, config: DaemonConfig, segment_bytes: int) -> OwnerSettings:
        return cls(config.storage_master, config.storage_metadata_server, config.storage_local_hostname,
                   config.storage_protocol, config.storage_device, segment_bytes)

    def command(self, port: int) -> list[str]:
        return [owner_binary(), f"--master_server_address={self.master}", f"--metadata_server={self.metadata_server}",
                f"--global_segment_size={self.segment_bytes}", f"--host={self.hostname}", f"--port={port}",
                f"--protocol={self.protocol}", f"--device_names={self.device}"]

    def environment(self) -> dict[str, str]:
        # The transfer engine advertises this address, not the host's first interface.
        return dict(os.environ, MC_TCP_BIND_ADDRESS=self.hostname)


class SegmentOwner:
    """A `mooncake_client` holding `segment_bytes` of the store, as a child
    process; ready once its log says it serves. A context manager."""

    def __init__(self, settings: OwnerSettings, log_path: Path, start_timeout_s: float = 60.0) -> None:
        self.settings = settings
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> SegmentOwner:
        ready = threading.Event()
        port = _free_port(self.settings.hostname)  # its IPC socket is named by its port: two owners never meet
        self.proc = subprocess.Popen(self.settings.command(port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.settings.environment())
        self._reader = threading.Thread(target=self._drain, args=(self.proc, ready), name="segment-owner-log",
                                        daemon=True)
        self._reader.start()
        if not ready.wait(self.start_timeout_s) or self.proc.poll() is not None:
            self.stop()
            raise Unavailable(f"the Mooncake segment owner did not start within {self.start_timeout_s:.0f}s "
                              f"(log: {self.log_path})")
        return self

    def _drain(self, proc: subprocess.Popen[bytes], ready: threading.Event) -> None:
        assert proc.stdout is not None
        with open(self.log_path, "ab") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if READY_LINE.encode() in line:
                    ready.set()
        ready.set()  # it exited: `start` looks at its exit

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(5)  # its log read to the end
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> SegmentOwner:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
