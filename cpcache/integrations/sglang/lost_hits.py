"""The scheduler's side of why hits were lost: pages a request could have
taken from the host pool or storage that the backend itself did not give it
(the daemons count the rest: docs/operations.md, "Why a hit was lost").
Logged at each flush_cache (`cpcache: rank N lost hits: ...`)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

REQUESTS_KEPT = 4096  # requests already counted while fallen back (SGLang matches a waiting one again)
REASONS = ("device_full", "load_failed", "fallback")


@dataclass
class LostHits:
    """Pages by reason: a host hit not loaded for want of device slots
    (`device_full`) or because its copy failed on some rank (`load_failed`);
    the pages past the device match of a request matched while the rank had
    fallen back to the device tree (`fallback`), each request once."""

    pages: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    _fallen: collections.OrderedDict[str, None] = field(default_factory=collections.OrderedDict)

    def lost(self, reason: str, pages: int) -> None:
        self.pages[reason] += pages

    def fell_back(self, rid: str, pages: int) -> None:
        """Request `rid`, matched while fallen back, had `pages` past the device match."""
        if rid in self._fallen:
            return
        self._fallen[rid] = None
        while len(self._fallen) > REQUESTS_KEPT:
            self._fallen.popitem(last=False)
        self.pages["fallback"] += pages

    def line(self, rank: int) -> str:
        """The logged line (tools/bench/serving.py reads it back)."""
        return f"cpcache: rank {rank} lost hits: " + ", ".join(f"{r} {n} pages" for r, n in self.pages.items())


def parse(line: str) -> dict[str, int]:
    """`line`'s counts by reason (the inverse of `LostHits.line`)."""
    _, _, counts = line.partition(" lost hits: ")
    out: dict[str, int] = {}
    for part in counts.split(", "):
        reason, _, rest = part.partition(" ")
        if reason in REASONS:
            out[reason] = int(rest.split()[0])
    return out
