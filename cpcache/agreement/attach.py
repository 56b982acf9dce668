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
                    attempt: int, timeout_s: float) -> None:
    """Publish `descriptor` as this rank's attach number `attempt` and wait
    until every rank of `ranks` has published the same descriptor. A peer's
    different descriptor fails the attach at once when it is at least as
    recent (its attempt number is not below this one; an older one may still
    be replaced by the peer's retry). After `timeout_s`: `FailedPrecondition`
    naming the ranks whose descriptor differs (and how), or `Unavailable`
    naming those that have not attached."""
    mine = json.dumps(descriptor, sort_keys=True)
    store.set(_key(namespace, rank), json.dumps({"attempt": attempt, "what": descriptor}, sort_keys=True))
    deadline = time.monotonic() + timeout_s
    while True:
        theirs: dict[int, tuple[int, str] | None] = {}
        for r in ranks:
            key = _key(namespace, r)
            if store.check([key]):
                published = json.loads(store.get(key))
                theirs[r] = (published["attempt"], json.dumps(published["what"], sort_keys=True))
            else:
                theirs[r] = None
        if all(t is not None and t[1] == mine for t in theirs.values()):
            return
        settled = all(t is not None and (t[1] == mine or t[0] >= attempt) for t in theirs.values())
        if settled or time.monotonic() > deadline:
            break  # every rank has said what it attaches now, and they differ: no point waiting
        time.sleep(POLL_S)  # a worker thread, polling a store that cannot notify changes
    differ = {r: json.loads(t[1]) for r, t in theirs.items() if t is not None and t[1] != mine}
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
