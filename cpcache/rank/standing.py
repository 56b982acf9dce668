"""A rank's standing in its epochs, and what the daemon running the rank
offers it: the daemon reads the one and implements the other without
importing the epochs' machinery (`rank/epochs.py`)."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Coroutine
from typing import Any, Protocol


class Standing(enum.Enum):
    FORMING = "forming"  # the domain has not formed yet
    SERVING = "serving"
    REFORMING = "reforming"  # the domain forms again in the next epoch
    BROKEN = "broken"  # the engine failed: decisions are refused


class RankHost(Protocol):
    """What the daemon running the rank offers it."""

    stop_requested: asyncio.Event

    def not_serving(self) -> str | None:
        """Why the daemon takes no decisions now ("joining", "draining"), or None."""

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run `coro` as a watched background task."""

    async def standing_changed(self, standing: Standing, note: str) -> None:
        """Tell health and the service manager (`note`: a status line, or "")."""
