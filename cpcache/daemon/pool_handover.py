"""Device pools handed over by descriptor, never opened by path.

A caller that names a file by path makes the daemon open it with the
daemon's rights (a confused deputy). So the daemon opens no pool a caller
names: the scheduler sends the descriptor of its pool over a unix socket
beside the daemon's own (`<socket>.pools`, born with the same mode and
group) and gets a one-time ticket for its Attach. The daemon can then map
only what the caller itself could open, and the kernel names the caller
(SO_PEERCRED), which the log records.

Anyone who may connect can also try to wear the daemon down, so every
resource here is bounded (`budget`): connections are served concurrently,
a few per uid, each within a short deadline; tickets are capped per uid and
in total and expire on a timer; only shmem memfds are kept (the only pools
`memfd.check_pool` accepts), told apart without a call into the file's file
system. Closing a descriptor can block in the
kernel (a TCP socket lingering, a FUSE file whose server never answers its
flush), and so can closing a connection with descriptors still queued on
it (the kernel drops them, closing them in the closer's thread). So every
connection is shut for reading and drained before it is closed, with room
for the most descriptors one message can carry; received TCP sockets are
un-lingered and memfds closed at once (neither can block); anything else
goes to the closer's threads. `pool_fds` receives descriptors and closes
them without blocking; `pool_tickets` keeps the table of tickets. Closes pending are counted per uid: a uid
over its share is refused, nobody else. A failed accept (EMFILE above all)
is waited out, never taken for a shutdown.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import grp
import logging
import os
import secrets
import socket
import struct
import threading
import time
import weakref

from cpcache.daemon import budget
from cpcache.daemon.pool_fds import Closer, close_now, drain, named_memfd, receive
from cpcache.daemon.pool_tickets import Tickets
from cpcache.dataplane.memfd import check_kind
from cpcache.dataplane.pools import HostPool
from cpcache.errors import CacheError, PermissionDenied

log = logging.getLogger("cpcached")

SUFFIX = ".pools"
HOST_ASK = b"host "  # + a ticket: a scheduler takes the host pool offered under it
# A scheduler takes its daemon's identity: a pidfd of the daemon's process
# (valid across pid namespaces, never a reused pid) and, read-only, the ring
# its step outcomes are recorded in (`step_outcomes`).
IDENTITY_ASK = b"identity"
HOST_TICKET_CHARS = 32
TICKET_TTL_S = budget.POOLS_TICKET_TTL_S
_UCRED = struct.Struct("3i")  # pid, uid, gid
# accept() failures that pass: out of descriptors or memory, or a peer gone before it was accepted.
_TEMPORARY = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO,
              errno.EPERM}
_BACKOFF_S = (0.01, 1.0)


class _Sometimes:
    """A warning at most every `every_s` per kind, with how many it stands for:
    a flood of bad connections must not become a flood of log lines."""

    def __init__(self, every_s: float = 30.0) -> None:
        self._every_s = every_s
        self._last: dict[str, float] = {}
        self._count: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def warn(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            self._count[kind] += 1
            if now - self._last.get(kind, -self._every_s) < self._every_s:
                return
            self._last[kind], count = now, self._count.pop(kind)
        log.warning("pool handover: " + message + " (%d like it since the last such warning)", *args, count)


class PoolHandover:
    def __init__(self, path: str, socket_group: str = "", outcomes_fd: int = -1) -> None:
        """`outcomes_fd`: the memfd of the daemon's step-outcome ring (-1: none)."""
        self.path = path
        self._outcomes_fd = outcomes_fd
        self._group = socket_group
        self._tickets = Tickets()
        self._serving: collections.Counter[int] = collections.Counter()  # uid -> connections served now
        self._lock = threading.Lock()  # `_serving` and `counters`; nothing that can block runs under it
        self._slots = threading.BoundedSemaphore(budget.POOLS_SERVED)
        self._stop = threading.Event()
        self._closer: Closer | None = None
        self._listener: socket.socket | None = None
        self._identity: tuple[int, int] | None = None
        self._warnings = _Sometimes()
        self.counters: collections.Counter[str] = collections.Counter()
        # Host pools offered to schedulers, read-only: ticket -> the pool (while it lives).
        self._host_pools: dict[str, weakref.ref[HostPool]] = {}

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
        listener.listen(budget.POOLS_BACKLOG)
        listener.settimeout(0.5)  # the acceptor looks at `_stop` this often
        self._listener = listener
        self._closer = Closer(budget.POOLS_CLOSERS)
        threading.Thread(target=self._accept_loop, args=(listener,), name="pool-handover", daemon=True).start()
        threading.Thread(target=self._expire_loop, name="pool-tickets", daemon=True).start()

    # -- accepting -------------------------------------------------------------

    def _accept_loop(self, listener: socket.socket) -> None:
        assert self._closer is not None
        backoff = 0.0
        try:
            while not self._stop.is_set():
                if not self._slots.acquire(timeout=0.5):
                    continue  # every server is busy: connections wait in the backlog
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    self._slots.release()
                    continue
                except OSError as exc:
                    self._slots.release()
                    if self._stop.is_set() or exc.errno in (errno.EBADF, errno.EINVAL):
                        return  # closed: the daemon stops
                    backoff = min(max(2 * backoff, _BACKOFF_S[0]), _BACKOFF_S[1])
                    self._count("accept_errors")
                    self._warnings.warn(f"accept-{exc.errno}", "accept failed (%s); retrying in %.2fs",
                                        exc.strerror, backoff)
                    if exc.errno not in _TEMPORARY:
                        log.debug("pool handover: unexpected accept error", exc_info=True)
                    self._stop.wait(backoff)
                    continue
                backoff = 0.0
                self._dispatch(conn)
        finally:
            listener.close()

    def _dispatch(self, conn: socket.socket) -> None:
        """Hand `conn` to a server thread of its own, unless its uid already
        has its share of them or of pending closes (then it is refused)."""
        assert self._closer is not None
        try:
            pid, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        except OSError:
            self._release(conn, -1)
            self._slots.release()
            return
        with self._lock:
            why = self._busy(uid)
            if not why:
                self._serving[uid] += 1
        if why:
            self._count(f"refused_{why}")
            self._warnings.warn(why, "uid %d already has its share of %s; refusing another", uid,
                                "connections served" if why == "busy" else "closes pending")
            with contextlib.suppress(OSError):
                conn.send(_refusal("UNAVAILABLE", "too many handovers from this uid at once; retry"),
                          socket.MSG_DONTWAIT)
            self._release(conn, uid)
            self._slots.release()
            return
        try:
            threading.Thread(target=self._serve_one, args=(conn, uid, pid), name="pool-handover-conn",
                             daemon=True).start()
        except RuntimeError:  # no thread to be had now: like EMFILE, it passes
            self._served(uid)
            self._release(conn, uid)
            self._stop.wait(0.1)

    def _busy(self, uid: int) -> str:
        """Why `uid` gets no server now ("" if it does). Under `_lock`."""
        assert self._closer is not None
        if self._serving[uid] >= budget.POOLS_SERVED_PER_UID:
            return "busy"
        if self._closer.pending_for(uid) >= budget.POOLS_PENDING_CLOSES_PER_UID:
            return "closes"
        return ""

    # -- serving one connection ----------------------------------------------------

    def _serve_one(self, conn: socket.socket, uid: int, pid: int) -> None:
        deadline = time.monotonic() + budget.POOLS_DEADLINE_S
        received: list[int] = []
        try:
            conn.settimeout(budget.POOLS_DEADLINE_S)
            answer = self._exchange(conn, uid, pid, received)
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            if isinstance(answer, tuple):  # descriptors: a host pool read-only, or the daemon's identity
                socket.send_fds(conn, [answer[0]], answer[1])
            else:
                conn.sendall(answer)
        except Exception as exc:  # a bad peer must not end anything but its own exchange
            self._count("failed")
            self._warnings.warn("failed", "an exchange with uid %d pid %d failed: %s", uid, pid, exc)
        finally:
            self._release_fds(received, uid)
            self._release(conn, uid)
            self._served(uid)

    def _release(self, conn: socket.socket, uid: int) -> None:
        """Close `conn` without closing anything queued on it: shut for
        reading (its peer can queue no more), drained, then closed here
        (nothing is left for the kernel to drop, so the close cannot block)."""
        try:
            conn.shutdown(socket.SHUT_RD)
            conn.setblocking(False)
            for fds in drain(conn):  # each message's at once: a long queue never piles up here
                self._release_fds(fds, uid)
        except OSError:
            pass
        finally:
            conn.close()

    def _release_fds(self, fds: list[int], uid: int) -> None:
        """Close received descriptors: those whose close cannot block here,
        the rest on the closer's threads, counted against `uid`."""
        assert self._closer is not None
        slow = [fd for fd in fds if not close_now(fd)]
        self._closer.close(uid, *slow)

    def _exchange(self, conn: socket.socket, uid: int, pid: int, received: list[int]
                  ) -> bytes | tuple[bytes, list[int]]:
        """The answer to one connection. Descriptors read land in `received`
        (closed by the caller); a kept one is taken out of it. `host TICKET`
        asks for a host pool offered under TICKET: (b"OK", [its descriptor]);
        `identity` for the daemon's: (b"OK", [pidfd, outcome ring or none])."""
        message, fds = receive(conn, 0)
        received.extend(fds)
        if message == IDENTITY_ASK and not fds:
            own = [os.pidfd_open(os.getpid())]
            ring = _reopen_read_only(self._outcomes_fd)
            if ring >= 0:
                own.append(ring)
            received.extend(own)  # closed once sent
            return b"OK", own
        if message.startswith(HOST_ASK):
            while len(message) < len(HOST_ASK) + HOST_TICKET_CHARS and not fds:
                more = conn.recv(len(HOST_ASK) + HOST_TICKET_CHARS - len(message))
                if not more:
                    break
                message += more
            with self._lock:
                offered = self._host_pools.get(message[len(HOST_ASK):].decode(errors="replace"))
            host_pool = offered() if offered is not None and not fds else None
            read_only = _reopen_read_only(host_pool.fd) if host_pool is not None else -1
            if read_only < 0:
                return _refusal("PERMISSION_DENIED", "unknown host pool ticket (the AttachReply names it)")
            received.append(read_only)  # closed once sent
            return b"OK", [read_only]
        if len(fds) != 1:
            return _refusal("INVALID_ARGUMENT", "send exactly one descriptor, the pool's")
        if not named_memfd(fds[0]):
            return _refusal("FAILED_PRECONDITION", "attach: the pool must be a shmem memfd (memfd_create); "
                                                   "DevicePool.create_sealed makes one")
        try:
            check_kind(fds[0])
        except CacheError as exc:
            return _refusal(exc.status, str(exc))
        ticket, full = self._tickets.issue(fds[0], uid, pid)
        if full:
            self._count("refused_tickets")
            self._warnings.warn("tickets", "uid %d: %s", uid, full)
            return _refusal("RESOURCE_EXHAUSTED", full)
        received.remove(fds[0])
        return ticket.encode()

    def _served(self, uid: int) -> None:
        with self._lock:
            self._serving[uid] -= 1
            if self._serving[uid] <= 0:
                del self._serving[uid]
        self._slots.release()

    def _count(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1

    # -- tickets ----------------------------------------------------------------

    def _expire_loop(self) -> None:
        while not self._stop.wait(1.0):
            self._expire()

    def _expire(self) -> None:
        expired = self._tickets.expire(TICKET_TTL_S)
        with self._lock:
            self.counters["expired"] += len(expired)
        if expired and self._closer is not None:
            self._release_fds([h.fd for h in expired], -1)

    def take(self, ticket: str) -> tuple[int, int, int]:
        """The descriptor a ticket stands for (once), with the uid and pid
        that handed it over."""
        handed = self._tickets.take(ticket)
        if handed is not None and time.monotonic() - handed.at > TICKET_TTL_S:
            if self._closer is not None:
                self._release_fds([handed.fd], handed.uid)
            handed = None
        if handed is None:
            raise PermissionDenied("attach: unknown, used or expired pool ticket; hand the pool over again "
                                   f"on {self.path} (cpcache.client does it)")
        return handed.fd, handed.uid, handed.pid

    def offer_host_pool(self, host: HostPool) -> str:
        """A ticket under which a scheduler takes a read-only descriptor of
        `host`'s memfd while the pool lives (the same ticket for the same
        pool): with it, a scheduler whose daemon died finishes the loads it
        left."""
        with self._lock:
            for ticket, offered in list(self._host_pools.items()):
                if offered() is None:
                    del self._host_pools[ticket]  # a pool let go
                elif offered() is host:
                    return ticket
            ticket = secrets.token_hex(HOST_TICKET_CHARS // 2)
            self._host_pools[ticket] = weakref.ref(host)
        return ticket

    @property
    def tickets(self) -> int:
        return len(self._tickets)

    def stats(self) -> dict[str, int]:
        """`pool_tickets_held` and the `pool_handover_*` counters, copied under the lock."""
        with self._lock:
            out = {f"pool_handover_{name}": n for name, n in self.counters.items()}
            out["pool_tickets_held"] = len(self._tickets)
        return out

    def close(self) -> None:
        self._stop.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the acceptor, which closes it
        with self._lock:
            self._host_pools = {}
        held = [h.fd for h in self._tickets.clear()]
        if held and self._closer is not None:
            self._release_fds(held, -1)
        with contextlib.suppress(FileNotFoundError):
            info = os.lstat(self.path)
            if (info.st_dev, info.st_ino) == self._identity:
                os.unlink(self.path)


def _refusal(status: str, message: str) -> bytes:
    """`ERR <STATUS> <message>`: the client raises the error of that status."""
    return f"ERR {status} {message}".encode()[:4000]


def _reopen_read_only(fd: int) -> int:
    """A new, read-only open of memfd `fd` (-1: it is closed)."""
    if fd < 0:
        return -1
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


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
