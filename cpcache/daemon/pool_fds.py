"""The descriptors a pool handover receives: read off a connection with room
for the most one message can carry (the kernel drops none, which would close
them in the receiving thread), told apart from the kernel's own tables (no
call into the file's file system, which a FUSE server may never answer), and
closed without blocking the thread that received them: memfds and
un-lingered TCP sockets at once, anything else on `Closer`'s threads."""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import socket
import struct
import threading
from collections.abc import Iterator

_LINGER_OFF = struct.pack("ii", 1, 0)  # close at once (RST), whatever linger the sender set
_FD = struct.Struct("i")
# Room for the most descriptors one message can carry (SCM_MAX_FD): with
# less, the kernel drops the rest, and the receiving thread closes them.
_CONTROL = socket.CMSG_SPACE(253 * _FD.size)


class Closer:
    """Closes descriptors on its own threads, counting per uid those not
    closed yet: a uid whose closes block is refused, not everyone."""

    def __init__(self, threads: int) -> None:
        self._queue: queue.SimpleQueue[tuple[int, tuple[socket.socket | int, ...]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: collections.Counter[int] = collections.Counter()
        for i in range(threads):
            threading.Thread(target=self._run, name=f"pool-closer-{i}", daemon=True).start()

    @property
    def pending(self) -> int:
        with self._lock:  # the closer threads change it meanwhile
            return sum(self._pending.values())

    def pending_for(self, uid: int) -> int:
        return self._pending[uid]

    def close(self, uid: int, *items: socket.socket | int) -> None:
        if not items:
            return
        with self._lock:
            self._pending[uid] += 1
        self._queue.put((uid, items))

    def _run(self) -> None:
        while True:
            uid, items = self._queue.get()
            for item in items:
                with contextlib.suppress(OSError):
                    if isinstance(item, socket.socket):
                        item.close()
                    else:
                        os.close(item)
            with self._lock:
                self._pending[uid] -= 1
                if self._pending[uid] <= 0:
                    del self._pending[uid]



def named_memfd(fd: int) -> bool:
    """Whether the kernel names `fd` a memfd (`/memfd:<name> (deleted)`).
    Asked of /proc, which answers from the kernel's own tables: fstat or
    fstatfs of a FUSE file would wait for its server, which may never
    answer. Without /proc, `check_kind` alone decides."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    except FileNotFoundError:
        return not os.path.isdir("/proc/self/fd")
    except OSError:
        return False


def receive(conn: socket.socket, flags: int) -> tuple[bytes, list[int]]:
    """One message and every descriptor it carries (room for the most a
    message can carry: the kernel drops none)."""
    data, ancillary, _, _ = conn.recvmsg(16, _CONTROL, flags | socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(fd for (fd,) in _FD.iter_unpack(payload[: len(payload) - len(payload) % _FD.size]))
    return data, fds


def drain(conn: socket.socket) -> Iterator[list[int]]:
    """The descriptors still queued on `conn`, message by message, until it
    is empty (shut for reading: the queue only shrinks)."""
    while True:
        try:
            data, fds = receive(conn, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        yield fds
        if not data and not fds:
            return  # end of stream: nothing more is queued


def _fd_kind(fd: int) -> str:
    """What the kernel names `fd` in /proc ("" if it cannot be read): read
    from its own tables, no call into the file's file system (fstat of a
    FUSE file waits for its server, which may never answer)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def close_now(fd: int) -> bool:
    """Close `fd` here if that cannot block: a memfd, or a TCP socket once
    un-lingered. False (`fd` still open) for anything else."""
    kind = _fd_kind(fd)
    if (kind.startswith("socket:[") and _unlinger(fd)) or kind.startswith("/memfd:"):
        with contextlib.suppress(OSError):
            os.close(fd)
        return True
    return False


def _unlinger(fd: int) -> bool:
    """Make a received socket close at once (RST), not after the linger its
    sender set. True for an IP socket: its close cannot block then (a unix
    socket may still hold descriptors queued on it)."""
    sock = socket.socket(fileno=fd)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_OFF)
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN) in (socket.AF_INET, socket.AF_INET6)
    except OSError:
        return False
    finally:
        sock.detach()

