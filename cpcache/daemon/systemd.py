"""sd_notify without libsystemd: READY, STATUS, STOPPING, WATCHDOG and
EXTEND_TIMEOUT_USEC messages as datagrams on $NOTIFY_SOCKET (resolved by the
entry point)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

# While waiting for peers the daemon asks systemd for this much more start
# time, every third of it: alive and joining, it is never killed for being
# slow; hung, it is killed within EXTEND_S of its last message.
EXTEND_S = 30.0

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, address: str | None) -> None:
        """`address`: the NOTIFY_SOCKET value; None or empty disables it.
        A leading '@' names an abstract socket."""
        self._address = None
        if address:
            self._address = "\0" + address[1:] if address.startswith("@") else address

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, **fields: str) -> None:
        if not self.enabled:
            return
        message = "\n".join(f"{key.upper()}={value}" for key, value in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(message, self._address or "")
        except OSError as exc:  # systemd gone or socket unwritable: nothing to tell
            log.warning("cannot notify systemd: %s", exc)

    def ready(self, status: str) -> None:
        self.send(ready="1", status=status)

    def status(self, status: str) -> None:
        self.send(status=status)

    def stopping(self, status: str) -> None:
        self.send(stopping="1", status=status)

    def watchdog(self) -> None:
        self.send(watchdog="1")

    def extend_timeout(self, seconds: float) -> None:
        """Ask for `seconds` more of the current start or stop timeout."""
        self.send(extend_timeout_usec=str(int(seconds * 1e6)))


async def extend_timeout_while(notifier: Notifier, waiting: Callable[[], bool], extend_s: float = EXTEND_S) -> None:
    """Extend systemd's timeout every third of `extend_s` while `waiting()`."""
    while waiting():
        notifier.extend_timeout(extend_s)
        await asyncio.sleep(extend_s / 3)
