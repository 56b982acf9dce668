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
            try:
                socket.send_fds(sock, [b"pool"], [fd])
            except BrokenPipeError:
                pass  # refused before anything was read (shut for reading): the answer says why
            answer = sock.recv(4096)
        except OSError as exc:
            raise errors.Unavailable(f"attach: cannot hand the pool over on {path}: {exc}") from None
    if not answer:
        raise errors.Unavailable(f"attach: the daemon on {path} closed the handover without an answer")
    if answer.startswith(b"ERR"):
        raise refusal(answer.decode(errors="replace"))
    return answer.decode()


_REFUSALS: dict[str, type[errors.CacheError]] = {
    "INVALID_ARGUMENT": errors.InvalidArgument, "FAILED_PRECONDITION": errors.FailedPrecondition,
    "RESOURCE_EXHAUSTED": errors.ResourceExhausted, "UNAVAILABLE": errors.Unavailable,
}


def refusal(answer: str) -> errors.CacheError:
    """The typed error of a refusal, `ERR <STATUS> <message>` (a daemon
    before statuses: `ERR <message>`, taken as INVALID_ARGUMENT)."""
    rest = answer.removeprefix("ERR").strip()
    status, _, message = rest.partition(" ")
    kind = _REFUSALS.get(status)
    if kind is None:
        kind, message = errors.InvalidArgument, rest
    return kind(f"attach: the daemon refused the pool: {message}")


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
