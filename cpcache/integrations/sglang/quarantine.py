"""Device slots held back from SGLang for a daemon that may still write them.

A load whose step failed (the daemon died, or its domain lost a peer) was
never decided: the daemon may have started copying host pages into its
device slots, and may still be. The slots go back to SGLang's allocator only
once that daemon's session has ended: when the rank attaches again (the new
session starts after the old one's jobs ended), or as soon as the daemon's
process has exited (it copies nothing any more). Until then they are held
by the cache, and SGLang's pool accounting counts them as protected, so its
idle leak check still balances.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cpcache.integrations.sglang.daemon_process import DaemonProcess


@dataclass
class _Held:
    slots: torch.Tensor
    daemon: DaemonProcess | None  # the process whose copies may land; None: unknown


class Quarantine:
    def __init__(self) -> None:
        self._held: list[_Held] = []

    def hold(self, slots: torch.Tensor, daemon: DaemonProcess | None) -> None:
        self._held.append(_Held(slots, daemon))

    def tokens(self) -> int:
        return sum(int(h.slots.numel()) for h in self._held)

    def release_exited(self, free: Callable[[torch.Tensor], None]) -> int:
        """Free the slots whose daemon process has exited: -> tokens freed."""
        exited: list[_Held] = []
        kept: list[_Held] = []
        for h in self._held:
            (exited if h.daemon is not None and h.daemon.exited() else kept).append(h)
        self._held = kept
        return self._free(exited, free)

    def release_all(self, free: Callable[[torch.Tensor], None]) -> int:
        """Every session they belong to has ended: -> tokens freed."""
        held, self._held = self._held, []
        return self._free(held, free)

    def forget(self) -> None:
        """SGLang is about to clear its allocator, these slots included."""
        self._close(self._held)
        self._held = []

    @classmethod
    def _free(cls, held: list[_Held], free: Callable[[torch.Tensor], None]) -> int:
        for h in held:
            free(h.slots)
        cls._close(held)
        return sum(int(h.slots.numel()) for h in held)

    @staticmethod
    def _close(held: list[_Held]) -> None:
        for h in held:
            if h.daemon is not None:
                h.daemon.close()
