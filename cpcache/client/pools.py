"""Handing a device pool to the daemon by descriptor (the daemon opens no
file by path): the pool's descriptor goes over `<socket>.pools`, and the
ticket that comes back goes into the Attach."""

from __future__ import annotations

import socket

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
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
            socket.send_fds(sock, [b"pool"], [fd])
            answer = sock.recv(256)
        except OSError as exc:
            raise errors.Unavailable(f"attach: cannot hand the pool over on {path}: {exc}") from None
    if not answer or answer.startswith(b"ERR"):
        raise errors.InvalidArgument(f"attach: the daemon refused the pool: {answer.decode(errors='replace')}")
    return answer.decode()
