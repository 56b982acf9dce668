"""Handing a device pool to the daemon by descriptor (the daemon opens no
file by path): the pool's descriptor goes over `<socket>.pools`, and the
ticket that comes back goes into the Attach. The same socket hands the
scheduler its daemon's host pool (read-only) and its identity: a pidfd of
its process and the ring its step outcomes are recorded in."""

from __future__ import annotations

import os
import socket
import struct
import time

from cpcache import errors

SUFFIX = ".pools"
HOST_ASK = b"host "  # + the ticket: take the daemon's host pool, read-only
IDENTITY_ASK = b"identity"  # take the daemon's pidfd and its step-outcome ring


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


def take_host_pool(address: str, ticket: str, timeout_s: float = 10.0) -> tuple[int, int]:
    """The daemon's host pool, read-only, offered under `ticket` (its
    AttachReply's `host_pool_ticket`): -> (descriptor, the daemon's pid, as
    the kernel names the peer of the socket)."""
    fds, pid = _ask(address, HOST_ASK + ticket.encode(), 1, "the host pool", timeout_s)
    return fds[0], pid


def take_identity(address: str, timeout_s: float = 10.0) -> tuple[int, int]:
    """The daemon's identity, by descriptor: -> (a pidfd of its process, its
    step-outcome ring read-only, or -1). A pidfd names the process itself:
    no pid is looked up, so none can have been reused, and it works across
    pid namespaces (the daemon in another container)."""
    fds, _ = _ask(address, IDENTITY_ASK, 2, "the daemon's identity", timeout_s)
    return fds[0], fds[1] if len(fds) > 1 else -1


def _ask(address: str, message: bytes, most: int, what: str, timeout_s: float) -> tuple[list[int], int]:
    """Send `message` on the daemon's `.pools` socket and take the answer's
    descriptors (1 to `most`): -> (them, the daemon's pid as the kernel
    names the peer; 0 out of this pid namespace's sight)."""
    path = handover_path(address)
    if path is None:
        raise errors.InvalidArgument(f"{what} is handed over on the daemon's unix socket; {address} is not one")
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            _connect(sock, path, deadline)
            pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
            sock.sendall(message)
            answer, fds, _, _ = socket.recv_fds(sock, 4096, most)
        except OSError as exc:
            raise errors.Unavailable(f"cannot take {what} on {path}: {exc}") from None
    if answer != b"OK" or not fds:
        for fd in fds:
            os.close(fd)
        raise refusal(answer.decode(errors="replace") or "ERR UNAVAILABLE the daemon closed the exchange")
    return fds, pid


_REFUSALS: dict[str, type[errors.CacheError]] = {
    "INVALID_ARGUMENT": errors.InvalidArgument, "FAILED_PRECONDITION": errors.FailedPrecondition,
    "RESOURCE_EXHAUSTED": errors.ResourceExhausted, "UNAVAILABLE": errors.Unavailable,
    "PERMISSION_DENIED": errors.PermissionDenied,
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
