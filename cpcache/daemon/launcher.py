"""Run a whole deployment's daemons on this machine: one `cpcached` process
per rank, a rendezvous store served by the launcher itself (so any daemon can
die without taking the store with it), and unix sockets under one run dir.

Used by `cpcache launch`, the demo, the tests and the benchmarks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from cpcache.agreement.collective import host_store
from cpcache.client import AsyncClient
from cpcache.config import DaemonConfig
from cpcache.daemon.segment_owner import OwnerSettings, SegmentOwner
from cpcache.daemon.settings import as_flags
from cpcache.errors import CacheError, InvalidArgument, Unavailable
from cpcache.topology import Topology

if TYPE_CHECKING:
    from torch.distributed import TCPStore


def private_run_dir(path: Path) -> None:
    """Create `path` fresh with mode 0700, or accept an existing directory
    only if this user owns it and nobody else may write it: the daemons'
    sockets and logs go there, and a directory another user can write lets
    them plant links that the logs would follow or replace the sockets."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise InvalidArgument(f"run dir {path}: not a directory (a link or file); give a fresh path")
    if info.st_uid != os.geteuid():
        raise InvalidArgument(f"run dir {path}: owned by uid {info.st_uid}, not by this user; give a fresh path")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise InvalidArgument(f"run dir {path}: group- or world-writable (mode {stat.S_IMODE(info.st_mode):o}); "
                              "give a fresh path or chmod it 0700")


def open_log(path: Path) -> BinaryIO:
    """Append to a rank's log, never through a link planted in its place."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, "ab")


@dataclass
class DomainSpec:
    topology: Topology
    run_dir: Path
    mode: str = "domain"
    agreement_lag: int = 0
    agreement_timeout_s: float = 10.0
    fault_delay_ms: float = 0.0
    seed: int = 0
    extra: dict = field(default_factory=dict)  # any other setting by name (`config.SETTINGS`), for every rank
    per_rank: dict = field(default_factory=dict)  # rank -> settings for that rank only (fault_* settings)
    # With Mooncake storage: one segment owner holds the memory every rank
    # would lend (the sum of their `storage_segment_bytes`) and the daemons
    # mount none, so no daemon's death takes pages out of the store
    # (`segment_owner`). False: each daemon mounts its own.
    segment_owner: bool = True

    def owner_bytes(self) -> int:
        """What the segment owner holds (0: none runs)."""
        if not self.segment_owner:
            return 0
        lent = [self._config(rank, 0, "").storage_segment_bytes for rank in range(self.topology.world_size)
                if self._config(rank, 0, "").storage == "mooncake"]
        return sum(lent)

    def config(self, rank: int, store_port: int, deployment: str) -> DaemonConfig:
        config = self._config(rank, store_port, deployment)
        if self.owner_bytes():
            return dataclasses.replace(config, storage_segment_bytes=0)  # the owner lends this rank's share
        return config

    def _config(self, rank: int, store_port: int, deployment: str) -> DaemonConfig:
        settings = dict(
            rank=rank,
            tp=self.topology.tp,
            pp=self.topology.pp,
            dp=self.topology.dp,
            cp=self.topology.cp,
            mode=self.mode,
            agreement_lag=self.agreement_lag,
            agreement_timeout_s=self.agreement_timeout_s,
            rendezvous=f"127.0.0.1:{store_port}",
            deployment=deployment,
            socket=str(self.run_dir / "rank-{rank}.sock"),
            fault_delay_ms=self.fault_delay_ms,
            fault_seed=self.seed,
        )
        return DaemonConfig.from_settings({**settings, **self.extra, **self.per_rank.get(rank, {})})


class ExitWatch:
    """A child's exit as a future of the event loop, told by its pidfd.

    No thread waits for any child: a pool of waiting threads (what
    `asyncio.to_thread(proc.wait)` borrows) runs out on a small host, and a
    cancelled wait never gives its thread back, so deaths went unseen."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self._loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[int] = self._loop.create_future()
        self._fd = -1
        try:
            self._fd = os.pidfd_open(proc.pid)
        except ProcessLookupError:  # already reaped by a poll(): its code is known
            pass
        if self._fd < 0:
            self._readable()
        else:
            self._loop.add_reader(self._fd, self._readable)
            self._readable()  # it may have exited before the reader was added

    def _readable(self) -> None:
        code = self.proc.poll()
        if code is None or self.exited.done():
            return
        self.close()
        self.exited.set_result(code)

    def close(self) -> None:
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1


class LocalDomain:
    """Async context manager: starts every rank, waits until all serve."""

    def __init__(self, spec: DomainSpec, start_timeout_s: float = 120.0) -> None:
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.procs: list[subprocess.Popen[bytes]] = []
        self._exits: list[ExitWatch] = []
        self.sockets: list[str] = []
        self.logs: list[Path] = []
        self._store: TCPStore | None = None
        self.segment_owner: SegmentOwner | None = None

    @property
    def size(self) -> int:
        return self.spec.topology.world_size

    async def __aenter__(self) -> LocalDomain:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def config(self, rank: int) -> DaemonConfig:
        assert self._store is not None, "the domain has not started"
        return self.spec.config(rank, self._store.port, self._deployment)

    async def start(self) -> None:
        private_run_dir(self.spec.run_dir)
        self._store = host_store("127.0.0.1", 0)
        self._deployment = f"local-{uuid.uuid4().hex[:8]}"
        owner_bytes = self.spec.owner_bytes()
        if owner_bytes:
            settings = OwnerSettings.of(self.spec._config(0, 0, ""), owner_bytes)
            self.segment_owner = SegmentOwner(settings, self.spec.run_dir / "segment-owner.log")
            await asyncio.to_thread(self.segment_owner.start)
        for rank in range(self.size):
            self.procs.append(self._spawn(rank))
            self._exits.append(ExitWatch(self.procs[rank]))
            self.sockets.append(self.config(rank).socket_path)
            self.logs.append(self.spec.run_dir / f"rank-{rank}.log")
        await asyncio.gather(*(self.wait_serving(rank) for rank in range(self.size)))

    def _spawn(self, rank: int) -> subprocess.Popen[bytes]:
        """Start `rank`'s daemon in a process group of its own: a terminal's
        Ctrl-C (SIGINT to the launcher's whole group) reaches the launcher
        alone, which stops each daemon with one SIGTERM (`stop`). Were the
        daemons in its group, each would see two signals, and a second
        signal means "exit now, without draining"."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open_log(self.spec.run_dir / f"rank-{rank}.log") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "cpcache.daemon", *as_flags(self.config(rank))],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, process_group=0,
            )

    async def restart(self, rank: int, timeout_s: float | None = None) -> None:
        """Start `rank` again once its process has exited (as a supervisor
        would) and wait until its domain has formed again with it: the
        rendezvous store lives here, in the launcher, so it outlives any
        daemon."""
        await asyncio.shield(self.exited(rank))
        self.respawn(rank)
        await self.wait_serving(rank, timeout_s)

    def exited(self, rank: int) -> asyncio.Future[int]:
        """The exit code of `rank`'s current process, once it has exited."""
        return self._exits[rank].exited

    def respawn(self, rank: int) -> None:
        """Start `rank` again; its last process must have exited."""
        assert self.exited(rank).done(), f"rank {rank} is still running"
        self.procs[rank] = self._spawn(rank)
        self._exits[rank] = ExitWatch(self.procs[rank])

    async def wait_serving(self, rank: int, timeout_s: float | None = None) -> None:
        """Until `rank`'s current process serves; `Unavailable` if it exits first."""
        timeout_s = timeout_s or self.start_timeout_s
        exited = self.exited(rank)
        deadline = time.monotonic() + timeout_s
        backoff_s = 0.05
        last_error: BaseException | None = None
        # A watch can fail before the new process listens (a socket file
        # left by the one it replaces): watched again, until the deadline.
        while not exited.done() and (left := deadline - time.monotonic()) > 0:
            async with AsyncClient(self.sockets[rank]) as client:
                serving = asyncio.ensure_future(client.wait_serving(left))
                either: set[asyncio.Future[Any]] = {exited, serving}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                if serving.done() and serving.exception() is None:
                    return
                serving.cancel()
                try:
                    await serving
                except (asyncio.CancelledError, CacheError) as exc:
                    last_error = exc
            # Waiting on the process's exit, not sleeping: it ends the wait if it dies.
            await asyncio.wait({exited}, timeout=min(backoff_s, max(0.0, deadline - time.monotonic())))
            backoff_s = min(2 * backoff_s, 1.0)
        tail = self.log_tail(rank)
        if exited.done():
            raise Unavailable(f"rank {rank} exited with code {exited.result()} while starting:\n{tail}")
        why = f" (last: {last_error})" if last_error is not None and str(last_error) else ""
        raise Unavailable(f"rank {rank} did not serve within {timeout_s}s{why}:\n{tail}")

    def restart_store(self) -> None:
        """Stop the rendezvous store and serve a new, empty one on the same
        port, as a restarted `cpcache store` would: it forgets every key."""
        assert self._store is not None, "the domain has not started"
        port = self._store.port
        self._store = None  # the server stops with its last reference
        self._store = host_store("127.0.0.1", port)

    def log_tail(self, rank: int, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.logs[rank].read_text(errors="replace").splitlines()[-lines:])
        return ""

    def signal(self, rank: int, sig: int) -> None:
        self.procs[rank].send_signal(sig)

    async def wait_exit(self, rank: int, timeout_s: float) -> int:
        return await asyncio.wait_for(asyncio.shield(self.exited(rank)), timeout_s)

    def force(self) -> None:
        """A second SIGTERM to every rank still running: "exit now" (a
        daemon that is draining exits 130 without finishing)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)

    async def stop(self, timeout_s: float | None = None) -> list[int | None]:
        """SIGTERM every rank still running (resuming stopped ones first) and
        wait for them; kill what does not exit in time. Returns exit codes."""
        timeout_s = timeout_s or self.spec.agreement_timeout_s + 10
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)
                    proc.send_signal(signal.SIGTERM)
        codes: list[int | None] = []
        for proc, watch in zip(self.procs, self._exits):
            try:
                codes.append(await asyncio.wait_for(asyncio.shield(watch.exited), timeout_s))
            except TimeoutError:
                proc.kill()
                codes.append(await watch.exited)
        self._store = None
        if self.segment_owner is not None:  # after the daemons: the store's memory outlives every one of them
            await asyncio.to_thread(self.segment_owner.stop)
            self.segment_owner = None
        return codes

