"""Whether the daemon process behind a unix socket is still alive.

Device slots that a daemon may still be copying into are given back to
SGLang once that daemon's session has ended. A process that has exited
copies nothing any more, so its end is as good as the session's: the
backend asks the kernel which process serves the socket (SO_PEERCRED) and
holds a pidfd to exactly that process, which becomes readable when it exits
(no pid reuse, no polling of /proc).

Not available (the answer is "unknown", never "gone") over TCP, when the
daemon runs in another pid namespace (a container: the kernel reports pid 0),
or on kernels without pidfd_open.
"""

from __future__ import annotations

import os
import select
import socket
import struct

_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def _unix_path(address: str) -> str | None:
    if address.startswith("unix://"):
        return address[len("unix://") :]
    if address.startswith("unix:"):
        return address[len("unix:") :]
    return address if address.startswith("/") else None


class DaemonProcess:
    """A pidfd to the process serving one unix socket."""

    def __init__(self, pidfd: int, pid: int) -> None:
        self._pidfd: int | None = pidfd
        self.pid = pid

    @staticmethod
    def serving(address: str, timeout_s: float = 2.0) -> DaemonProcess | None:
        """The process that accepts connections at `address` now, or None
        when that cannot be known."""
        path = _unix_path(address)
        if path is None or not hasattr(os, "pidfd_open") or not hasattr(socket, "SO_PEERCRED"):
            return None
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(timeout_s)
                probe.connect(path)
                pid, _, _ = _PEERCRED.unpack(probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            if pid <= 0:
                return None  # another pid namespace
            return DaemonProcess(os.pidfd_open(pid), pid)
        except OSError:
            return None

    def exited(self) -> bool:
        """True once the process has exited (a pidfd polls readable then)."""
        if self._pidfd is None:
            return False  # closed: unknown
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:  # a connector left behind at a fallback, its process not watched any more
        self.close()
