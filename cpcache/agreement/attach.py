"""Agreeing on what every rank attaches (geometry, pool sizes, the settings
that shape the shared state) before the cache is used.

Each rank publishes its latest attach descriptor in the rendezvous store and
waits until every rank of the domain has published the same one; as soon as
all have published and they differ, every rank fails naming what differs. A
daemon attaches once, so the latest descriptor is all that matters. A rank
that fails locally or times out withdraws its own, so no peer matches a dead
attempt; a descriptor that differs stays, so every rank sees the same
difference (a scheduler then attaches again on every rank). Knows nothing
about caches: a descriptor is a flat JSON object.
"""

from __future__ import annotations

import json
import time
from typing import Any

from cpcache.errors import FailedPrecondition, Unavailable

POLL_S = 0.02  # how often a waiting rank looks at its peers' descriptors


def _key(namespace: str, rank: int) -> str:
    return f"{namespace}/attach/{rank}"


def withdraw(store: Any, namespace: str, rank: int) -> None:
    """This rank's attach failed: peers must not match an older descriptor."""
    store.delete_key(_key(namespace, rank))


def agree_on_attach(store: Any, namespace: str, rank: int, ranks: tuple[int, ...], descriptor: dict[str, Any],
                    timeout_s: float) -> None:
    """Publish `descriptor` and wait until every rank of `ranks` has published
    the same. After `timeout_s`: `FailedPrecondition` naming the ranks whose
    descriptor differs (and how), or `Unavailable` naming those that have not
    attached."""
    mine = json.dumps(descriptor, sort_keys=True)
    store.set(_key(namespace, rank), mine)
    deadline = time.monotonic() + timeout_s
    while True:
        theirs: dict[int, str | None] = {}
        for r in ranks:
            key = _key(namespace, r)
            theirs[r] = store.get(key).decode() if store.check([key]) else None
        if all(t == mine for t in theirs.values()):
            return
        if all(t is not None for t in theirs.values()) or time.monotonic() > deadline:
            break  # every rank has said what it attaches, and they differ: no point waiting
        time.sleep(POLL_S)  # a worker thread, polling a store that cannot notify changes
    differ = {r: json.loads(t) for r, t in theirs.items() if t is not None and t != mine}
    if differ:
        fields = sorted(k for k in descriptor if any(d.get(k) != descriptor[k] for d in differ.values()))
        listing = "; ".join(f"ranks [{r}]: " + ", ".join(f"{k}={d.get(k)!r}" for k in fields)
                            for r, d in sorted(differ.items()))
        raise FailedPrecondition(
            f"attach: the ranks differ in {', '.join(fields)} (ranks [{rank}]: "
            + ", ".join(f"{k}={descriptor[k]!r}" for k in fields) + f"; {listing}); nothing was attached")
    missing = sorted(r for r, t in theirs.items() if t is None)
    raise Unavailable(f"attach: ranks {missing} did not attach within {timeout_s:.0f}s; every rank of the "
                      f"domain must attach the same pool")
