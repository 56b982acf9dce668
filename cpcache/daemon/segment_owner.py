"""The memory of a Mooncake Store, held by a process that outlives daemons.

A Mooncake client that mounts a segment lends the store its memory: every
object placed in that segment lives only while the client does. When a
daemon mounts one and dies, the master expires its lease and unmounts the
segment, and every page in it leaves the store; the writes of the peers that
placed pages there fail (`TRANSFER_FAIL` to the dead daemon's port). So the
daemons mount nothing (`storage_segment_bytes = 0`: they only put and get)
and one segment owner per host holds the memory: a Mooncake client of
cpcache's own (below; Mooncake's split of a per-host real client that holds
segments and light clients that use it), which `cpcache launch` keeps for
as long as it runs and `cpcache segment-owner` runs as a service of its own
(docs/operations.md). A daemon killed, restarted or stopped leaves the store
as it was, and a re-formed domain starts warm from it.

The owner is a Mooncake client of its own, in a process of its own
(`python -m cpcache.daemon.segment_owner`): it mounts its segment, says so
on its output, and on SIGTERM or SIGINT unmounts it before it exits, so
the master never places a page in memory that is gone (Mooncake's
`mooncake_client` dies on those signals with its segment still mounted,
and the master's puts fail there until its lease expires).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from cpcache.config import DaemonConfig
from cpcache.errors import Unavailable

READY_LINE = "segment owner: mounted"


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

    def command(self) -> list[str]:
        return [sys.executable, "-m", "cpcache.daemon.segment_owner", self.master, self.metadata_server,
                self.hostname, self.protocol, self.device, str(self.segment_bytes)]

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
        # A process group of its own, as the daemons': a terminal's Ctrl-C
        # reaches the launcher alone, which stops the owner after its daemons.
        self.proc = subprocess.Popen(self.settings.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.settings.environment(), process_group=0)
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


def serve(settings: OwnerSettings) -> int:
    """The owner's process: mount the segment, hold it until SIGTERM, SIGINT
    or SIGHUP, unmount it. -> the exit code."""
    from mooncake.store import MooncakeDistributedStore

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    store = MooncakeDistributedStore()
    rc = store.setup(settings.hostname, settings.metadata_server, settings.segment_bytes, 0, settings.protocol,
                     settings.device, settings.master)
    if rc != 0:
        print(f"segment owner: setup against master {settings.master} failed with code {rc}", flush=True)
        return 1
    print(f"{READY_LINE} {settings.segment_bytes} bytes in the store at {settings.master}", flush=True)
    while not stop.wait(1.0):
        pass
    store.close()  # unmounts the segment: the master places nothing more there
    print("segment owner: unmounted", flush=True)
    return 0


if __name__ == "__main__":
    master, metadata, hostname, protocol, device, size = sys.argv[1:7]
    sys.exit(serve(OwnerSettings(master, metadata, hostname, protocol, device, int(size))))
