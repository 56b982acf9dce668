"""Handing a device pool to the daemon by descriptor (the daemon opens no
file by path): the pool's descriptor goes over `<socket>.pools`, and the
ticket that comes back goes into the Attach."""

from __future__ import annotations

import socket
import time

from cpcache import errors

SUFFIX = ".pools"


def handover_path(address: str) -> str | None:
    """The handover socket beside a daemon's unix socket (None over TCP)."""
    if address.startswith("unix:"):
        address = address[len("unix:"):]
    if address.startswith("/") or address.endswith(".sock"):
        return address + SUFFIX
    return None


def hand_over(address: str, fd: int, timeout_s: float = 10.0) -> str:
    path = handover_path(address)
    if path is None:
        raise errors.InvalidArgument("attach: a shared-memory pool is handed over on the daemon's unix socket; "
                                     f"{address} is not one (over TCP, attach a CUDA pool)")
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            _connect(sock, path, deadline)
            socket.send_fds(sock, [b"pool"], [fd])
            answer = sock.recv(256)
        except OSError as exc:
            raise errors.Unavailable(f"attach: cannot hand the pool over on {path}: {exc}") from None
    if not answer or answer.startswith(b"ERR"):
        raise errors.InvalidArgument(f"attach: the daemon refused the pool: {answer.decode(errors='replace')}")
    return answer.decode()


def _connect(sock: socket.socket, path: str, deadline: float) -> None:
    """Connect, waiting out a full listen backlog (a unix socket with a
    timeout answers EAGAIN at once then, where TCP would wait): the daemon
    drains it, also while others flood it."""
    pause = 0.001
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
