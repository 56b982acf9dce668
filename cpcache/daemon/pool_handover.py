"""Device pools handed over by descriptor, never opened by path.

A caller that names a file by path makes the daemon open it with the
daemon's rights (a confused deputy). So the daemon opens no pool a caller
names: the scheduler sends the descriptor of its pool over a unix socket
beside the daemon's own (`<socket>.pools`, born with the same mode and
group) and gets a one-time ticket for its Attach. The daemon can then map
only what the caller itself could open, and the kernel names the caller
(SO_PEERCRED), which the log records.

A pool must be a memfd sealed against shrinking (F_SEAL_SHRINK): a file
that shrinks under the daemon's mapping would kill it with SIGBUS.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass

from cpcache.errors import PermissionDenied

log = logging.getLogger("cpcached")

SUFFIX = ".pools"
TICKET_TTL_S = 120.0
_UCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass
class _Handed:
    fd: int
    uid: int
    pid: int
    at: float


class PoolHandover:
    def __init__(self, path: str, socket_group: str = "") -> None:
        self.path = path
        self._group = socket_group
        self._tickets: dict[str, _Handed] = {}
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._identity: tuple[int, int] | None = None

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            if not os.path.exists(self.path) or _stale(self.path):
                os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o117 if self._group else 0o177)  # born 0600 (0660): no chmod by path
        try:
            listener.bind(self.path)
        finally:
            os.umask(old)
        if self._group:
            os.chown(self.path, -1, grp.getgrnam(self._group).gr_gid, follow_symlinks=False)
        info = os.lstat(self.path)
        self._identity = (info.st_dev, info.st_ino)
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._serve, name="pool-handover", daemon=True).start()

    def _serve(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed: the daemon stops
            with conn:
                conn.settimeout(5.0)
                try:
                    self._receive(conn)
                except Exception as exc:  # a bad peer must not end the handover thread
                    log.warning("pool handover failed: %s", exc)

    def _receive(self, conn: socket.socket) -> None:
        pid, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        _, fds, _, _ = socket.recv_fds(conn, 16, 4)
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            conn.sendall(b"ERR send exactly one descriptor")
            return
        ticket = secrets.token_hex(16)
        with self._lock:
            self._expire()
            self._tickets[ticket] = _Handed(fds[0], uid, pid, time.monotonic())
        conn.sendall(ticket.encode())

    def _expire(self) -> None:
        now = time.monotonic()
        for ticket in [t for t, h in self._tickets.items() if now - h.at > TICKET_TTL_S]:
            os.close(self._tickets.pop(ticket).fd)

    def take(self, ticket: str) -> tuple[int, int, int]:
        """The descriptor a ticket stands for (once), with the uid and pid
        that handed it over."""
        with self._lock:
            self._expire()
            handed = self._tickets.pop(ticket, None)
        if handed is None:
            raise PermissionDenied("attach: unknown or used pool ticket; hand the pool over again "
                                   f"on {self.path} (cpcache.client does it)")
        return handed.fd, handed.uid, handed.pid

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            for handed in self._tickets.values():
                os.close(handed.fd)
            self._tickets.clear()
        with contextlib.suppress(FileNotFoundError):
            info = os.lstat(self.path)
            if (info.st_dev, info.st_ino) == self._identity:
                os.unlink(self.path)


def _stale(path: str) -> bool:
    """Whether nobody accepts on the socket at `path` (a previous run's)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return True
    finally:
        probe.close()
    return False
