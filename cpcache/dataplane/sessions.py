"""Data-plane sessions: the fence between a scheduler session (of one epoch)
and the next (docs/design.md rule 10).

Every job is issued in one session and binds that session's device pool when
it is issued, never when it runs: a job that outlives its session can only
touch the pool it was issued for. A session ends once, when its epoch or its
scheduler's session does; from then on the movers refuse its storage jobs
that have not started yet (counted), while its device <-> host copies issued
before the end run to their end: a forward may be reading a load as it lands
(docs/design.md rule 12), and a write-through was acknowledged. The session counts
the jobs not yet ended, so that whoever hands its pools or slots on waits for
that count to reach zero instead of for a time.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cpcache.dataplane.pools import DevicePool


class Session:
    def __init__(self, epoch: int, number: int, device: DevicePool | None) -> None:
        self.epoch = epoch
        self.number = number  # the how-manieth session this daemon opened
        self.device = device
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)
        self._live = 0  # jobs issued and not yet ended (run, refused or cancelled)
        self._device_live = 0  # those that touch the device pool
        self._ended = False
        self.refused = 0  # jobs refused because they would have run after the end

    def __repr__(self) -> str:
        return f"Session(epoch={self.epoch}, number={self.number})"

    @property
    def ended(self) -> bool:
        return self._ended

    def issue(self, touches_device: bool) -> bool:
        """A job of this session was issued (counted even after the end: it
        is refused when it would run, and ends then). -> whether the session
        was still open."""
        with self._lock:
            self._live += 1
            self._device_live += touches_device
            return not self._ended

    def admit(self, finish: bool = False) -> bool:
        """On the I/O thread, right before the job touches anything: False
        (and counted) once the session has ended, unless `finish` (a copy
        issued while it was open, which runs to its end)."""
        with self._lock:
            if self._ended and not finish:
                self.refused += 1
                return False
            return True

    def job_ended(self, touches_device: bool) -> None:
        with self._lock:
            self._live -= 1
            self._device_live -= touches_device
            self._quiet.notify_all()

    def end(self) -> None:
        """No job of this session starts from now on, but the copies issued
        before (see `admit`)."""
        with self._lock:
            self._ended = True

    def live(self) -> int:
        with self._lock:
            return self._live

    def wait_device_quiet(self, timeout_s: float | None = None) -> bool:
        """Until no job of this session touches its device pool. Untimed by
        default: once ended, only copies issued before remain, and a copy
        between memory pools ends (storage calls never touch the pool)."""
        with self._lock:
            return self._quiet.wait_for(lambda: self._device_live == 0, timeout_s)
