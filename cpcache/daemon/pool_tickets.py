"""The one-time tickets a pool handover gives for the descriptors it keeps:
capped per uid and in total, each worth one Attach, expiring after a TTL.
The table only; the handover closes what leaves it."""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

from cpcache.daemon import budget


@dataclass
class Handed:
    """A kept descriptor, and who handed it over when."""

    fd: int
    uid: int
    pid: int
    at: float


class Tickets:
    def __init__(self) -> None:
        self._held: dict[str, Handed] = {}
        self._lock = threading.Lock()  # handover threads, the expiry timer and Attach share the table

    def issue(self, fd: int, uid: int, pid: int) -> tuple[str, str]:
        """A fresh ticket for `fd` and "", or "" and why `uid` may hold no more."""
        ticket = secrets.token_hex(16)
        with self._lock:
            full = self._full(uid)
            if not full:
                self._held[ticket] = Handed(fd, uid, pid, time.monotonic())
        return ("", full) if full else (ticket, "")

    def _full(self, uid: int) -> str:
        """Why `uid` may hold no more tickets ("" if it may). Under `_lock`."""
        mine = sum(1 for h in self._held.values() if h.uid == uid)
        if mine >= budget.POOLS_TICKETS_PER_UID or len(self._held) >= budget.POOLS_TICKETS:
            return (f"too many pool tickets held (this uid: {mine} of {budget.POOLS_TICKETS_PER_UID}, all: "
                    f"{len(self._held)} of {budget.POOLS_TICKETS}); attach with them, or wait "
                    f"{budget.POOLS_TICKET_TTL_S:.0f}s for unused ones to expire")
        return ""

    def expire(self, ttl_s: float) -> list[Handed]:
        """Take out every ticket older than `ttl_s`."""
        now = time.monotonic()
        with self._lock:
            return [self._held.pop(t) for t, h in list(self._held.items()) if now - h.at > ttl_s]

    def take(self, ticket: str) -> Handed | None:
        """What `ticket` stands for, once (None if unknown or used)."""
        with self._lock:
            return self._held.pop(ticket, None)

    def clear(self) -> list[Handed]:
        """Take out every ticket."""
        with self._lock:
            held = list(self._held.values())
            self._held.clear()
        return held

    def __len__(self) -> int:
        return len(self._held)
