"""This rank's daemon, as its scheduler holds it: a pidfd of its process and
the ring of its step outcomes (docs/design.md rule 12).

The pidfd comes from the daemon itself, over its `.pools` socket, never
from a pid: it cannot name a process that reused the daemon's pid, and it
works when the daemon runs in another pid namespace (another container).
With it the scheduler knows when the daemon can write nothing more (its
process has exited) and, if it must, stops it. The ring tells how a step
ended when the daemon died between its round and its reply.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal

from cpcache.client.pools import take_identity
from cpcache.errors import Unavailable
from cpcache.step_outcomes import OutcomeReader


class DaemonProcess:
    """A daemon's process by its pidfd (owned: closed by `close`)."""

    def __init__(self, pidfd: int) -> None:
        self._pidfd = pidfd

    def gone(self) -> bool:
        """Whether the process has exited (it can write nothing more)."""
        return self._pidfd >= 0 and bool(select.select([self._pidfd], [], [], 0)[0])

    def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the process to exit. -> whether it has."""
        return self._pidfd >= 0 and bool(select.select([self._pidfd], [], [], max(0.0, timeout_s))[0])

    def stop(self, timeout_s: float) -> bool:
        """Make sure the daemon writes nothing more: kill it if it still runs,
        and wait for its exit. -> whether it has exited (False: this process
        may not signal it, or it did not exit in time). Signalling needs the
        daemon in this process's pid namespace or one below it (a container
        sharing the scheduler's, e.g. compose `pid: service:...`, Kubernetes
        `shareProcessNamespace`); its exit is seen from anywhere."""
        if self._pidfd < 0:
            return False
        if not self.gone():
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                return True
            except OSError:  # EPERM: not ours to signal; EINVAL: out of sight (a sibling pid namespace)
                return False
        return self.wait(timeout_s)

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


class HeldDaemon:
    """A daemon's process and its outcome ring, taken at once."""

    def __init__(self, process: DaemonProcess, outcomes: OutcomeReader | None) -> None:
        self.process = process
        self.outcomes = outcomes

    @classmethod
    def take(cls, address: str, timeout_s: float = 10.0, instance: int = 0) -> HeldDaemon:
        """Ask the daemon at `address` for its identity (`CacheError` if it
        cannot be had: TCP, a daemon that is down or too old). `instance`:
        the one an Attach answered from (`AttachReply.daemon_instance`); a
        daemon restarted since is another process, and is refused
        (`Unavailable`) rather than held in its place."""
        pidfd, ring = take_identity(address, timeout_s)
        outcomes = None
        if ring >= 0:
            with contextlib.suppress(OSError, ValueError):  # not a ring: only the process is held
                outcomes = OutcomeReader(ring)
        held = cls(DaemonProcess(pidfd), outcomes)
        if instance and (outcomes is None or outcomes.instance != instance):
            held.close()
            raise Unavailable(f"the daemon at {address} is not the instance that answered the Attach (it restarted "
                              "since)")
        return held

    def recorded(self, epoch: int, step: int) -> bytes | None:
        return self.outcomes.find(epoch, step) if self.outcomes is not None else None

    def close(self) -> None:
        self.process.close()
        if self.outcomes is not None:
            self.outcomes.close()
            self.outcomes = None
