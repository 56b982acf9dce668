"""What a daemon had open when a fault hit it, for the chaos benches (with
SGLang and without): read from its Status and Stats, never needing SGLang."""

from __future__ import annotations

from typing import Any

from cpcache.client import Client

# What a daemon may have open, by its Stats counter (`CacheState.stats`).
OPEN_KINDS = {"load": "open_loads", "write": "open_writes", "prefetch": "open_prefetches", "backup": "open_backups"}


def what_is_open(socket: str, timeout_s: float = 2.0) -> dict[str, Any]:
    """The daemon's Status and Stats, as far as what it has open goes."""
    try:
        with Client(socket, timeout_s=timeout_s) as daemon:
            status = daemon.status()
            stats = dict(daemon.stats())
    except Exception as exc:  # restarting, stopping, or stopped: the fault lands all the same
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"state": status.state, "attached": status.attached, "epoch": status.epoch,
            "open_questions": status.open_questions, "in_flight_slots": stats.get("in_flight_slots", 0),
            **{counter: stats.get(counter, 0) for counter in OPEN_KINDS.values()}}


def open_labels(seen: dict[str, Any]) -> list[str]:
    """What a fault interrupted: one label per kind of operation open on
    the victim's daemon; `unreachable` (no answer), `detached` (serving, no
    scheduler attached), `nothing`."""
    if "error" in seen:
        return ["unreachable"]
    if not seen.get("attached"):
        return ["detached"]
    labels = [kind for kind, counter in OPEN_KINDS.items() if seen.get(counter)]
    if not labels and seen.get("open_questions"):
        labels = ["questions"]
    return labels or ["nothing"]
