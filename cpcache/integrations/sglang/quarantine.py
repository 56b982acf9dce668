"""Device slots held back from SGLang for a daemon that may still write them.

A load whose step failed (the daemon died, or its domain lost a peer) was
never decided: the daemon may have started copying host pages into its
device slots, and may still be. The slots go back to SGLang's allocator only
once that daemon's session has ended, which the rank learns when it attaches
again (the new session starts after the old one's jobs ended). Until then
they are held by the cache, and SGLang's pool accounting counts them as
protected, so its idle leak check still balances.

The slots come back at that agreed iteration and never at a local one
(say, when this rank's daemon process is seen to exit): every rank's
scheduler admits requests by its own free slots, so ranks whose allocators
differ build different batches, and the model's next collective fails.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Quarantine:
    def __init__(self) -> None:
        self._held: list[torch.Tensor] = []

    def hold(self, slots: torch.Tensor) -> None:
        self._held.append(slots)

    def tokens(self) -> int:
        return sum(int(slots.numel()) for slots in self._held)

    def release(self, free: Callable[[torch.Tensor], None]) -> int:
        """Every session they belong to has ended: -> tokens freed."""
        tokens = self.tokens()
        for slots in self._held:
            free(slots)
        self._held = []
        return tokens

    def forget(self) -> None:
        """SGLang is about to clear its allocator, these slots included."""
        self._held = []
