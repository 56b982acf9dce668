"""Agreeing on what every rank attaches (geometry, pool sizes, the settings
that shape the shared state) before the cache is used (docs/design.md rule 11).

An Attach is decided once per *attempt*, and every rank of the domain follows
that one decision, whatever its own timing:

- Attempts are numbered within an epoch. A rank joins the first attempt not
  yet decided (and never one it joined already), publishes its descriptor
  there once (a compare-and-set: never replaced, never withdrawn), and waits
  for the attempt's decision.
- The decision is one record, written by compare-and-set, so the first
  writer wins and everybody reads the same: "attached" once every rank has
  published the same descriptor, "differ" (with every descriptor) once every
  rank has published and they differ, "missing" (naming who) when a rank's
  own deadline passes first. A rank whose deadline passes after a peer wrote
  "attached" reads "attached": no split at any timeout.
- A descriptor only ever counts in its own attempt: a refused attempt's
  descriptor can never match a later one (no stale descriptors), and since
  the next attach of every rank joins the next undecided attempt, attaching
  again everywhere converges.
- The store is not trusted to keep the decision: a store that restarts
  mid-attempt forgets it, and two ranks could read two decisions. So a rank
  that read "attached" or "differ" (every rank published) confirms it in one
  MIN round of the domain over (attempt, the decision's fingerprint) on a
  group used for nothing else; it attaches only if every rank read the same.
  A rank that read "missing" enters no round: its peers' round then times
  out, and they refuse too (and re-form the domain, since a collective that
  timed out leaves its group unusable). Store errors are retried until the
  rank's deadline, then refused: UNAVAILABLE, never a split.

Knows nothing about caches: a descriptor is a flat JSON object.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from cpcache.agreement.bounded import bounded
from cpcache.errors import FailedPrecondition, Unavailable
from cpcache.hashing import hash62

if TYPE_CHECKING:  # the collective module imports torch; a confirmation needs only its vector MIN
    from cpcache.agreement.collective import Reducer

log = logging.getLogger(__name__)

POLL_S = 0.02  # how often a waiting rank looks at the attempt (the store cannot notify changes)
STORE_CALL_S = 5.0  # the longest one look at the store may take before it is abandoned

ATTACHED, DIFFER, MISSING = "attached", "differ", "missing"


def _prefix(namespace: str) -> str:
    return f"{namespace}/attach"


def _published(namespace: str, attempt: int, rank: int) -> str:
    return f"{_prefix(namespace)}/{attempt}/rank{rank}"


def _decision(namespace: str, attempt: int) -> str:
    return f"{_prefix(namespace)}/{attempt}/decision"


def _decided(namespace: str) -> str:
    return f"{_prefix(namespace)}/decided"  # the highest attempt with a decision


class Unconfirmed(Unavailable):
    """The confirmation round did not complete: its group is unusable, and
    the domain must form again before the next attach."""


def next_attempt(store: Any, namespace: str, after: int) -> int:
    """The attempt an attach of this rank joins: the first one not yet
    decided, and later than `after` (the last one this rank joined)."""
    return max(int(store.add(_decided(namespace), 0)), after) + 1


def agree_on_attach(connect: Callable[[], Any], namespace: str, rank: int, ranks: tuple[int, ...],
                    descriptor: dict[str, Any], after: int, timeout_s: float, confirm_with: Reducer,
                    clock: Any = time.monotonic, pause: Any = time.sleep,
                    on_attempt: Callable[[int], None] = lambda attempt: None) -> None:
    """Join the next attempt after `after` (told to `on_attempt`), publish
    `descriptor` as this rank's there and follow the attempt's decision once
    every rank confirmed it: return if attached; `FailedPrecondition` naming
    what differs; `Unavailable` naming the ranks that did not attach in time,
    or saying that the store failed; `Unconfirmed` when the confirmation
    round did not complete."""
    deadline = clock() + timeout_s
    joined: Attempt | None = None
    published = False

    def one_look(joined: Attempt | None, published: bool, expired: bool) -> tuple[Attempt, dict[str, Any] | None]:
        # Builds new objects rather than changing the caller's: an abandoned
        # call (the store stopped answering) must not touch what goes on.
        if joined is None:
            store = connect()
            joined = Attempt(store, namespace, rank, ranks, descriptor, next_attempt(store, namespace, after))
        elif joined.store is None:
            joined = Attempt(connect(), namespace, rank, ranks, descriptor, joined.attempt)
        if not published:  # once per connection: a restarted store forgot it
            joined.publish()
        return joined, joined.look(expired=expired)

    while True:
        try:
            limit = max(0.5, min(STORE_CALL_S, deadline - clock() + 0.5))
            looked, decision = bounded(functools.partial(one_look, joined, published, clock() > deadline), limit,
                                       "the attach's store calls")
            if joined is None or looked.attempt != joined.attempt:
                on_attempt(looked.attempt)
            joined, published = looked, True
            if decision is not None:
                break
        except (RuntimeError, OSError, ValueError) as exc:  # the store failed, restarted or stopped answering
            log.warning("attach: the rendezvous store failed (%s: %s); retrying until the deadline",
                        type(exc).__name__, exc)
            if joined is not None:
                joined = Attempt(None, namespace, rank, ranks, descriptor, joined.attempt)  # connect again
            published = False
            if clock() > deadline:
                raise Unavailable(f"attach: the rendezvous store failed ({type(exc).__name__}: {exc}); nothing "
                                  f"was attached on this rank: attach again on every rank") from None
        pause(POLL_S)
    assert joined is not None
    if decision["outcome"] in (ATTACHED, DIFFER):
        confirm(confirm_with, joined.attempt, decision)
    follow(decision, rank, descriptor, timeout_s)


def confirm(reducer: Reducer, attempt: int, decision: dict[str, Any]) -> None:
    """One MIN round of the domain over what this rank read: returns if
    every rank read this same decision of this same attempt."""
    mine = confirmation_vector(attempt, decision)
    vector = mine.copy()
    try:
        reducer.min_inplace(vector)
    except RuntimeError as exc:  # a peer never entered (it read another outcome) or is gone
        raise Unconfirmed(f"attach: attempt {attempt} was not confirmed by every rank ({exc}); nothing was "
                          f"attached on any rank: the domain forms again, then attach again on every rank") from None
    if not np.array_equal(vector, mine):
        raise Unavailable(f"attach: the ranks read different decisions of attempt {attempt} (the rendezvous store "
                          f"restarted while it was decided); nothing was attached on any rank: attach again on "
                          f"every rank")


def confirmation_vector(attempt: int, decision: dict[str, Any]) -> np.ndarray:
    """What a rank brings to the confirmation round: its MIN over the domain
    equals it on every rank only if every rank brought the same."""
    fingerprint = hash62(json.dumps(decision, sort_keys=True).encode())
    return np.array([attempt, -attempt, fingerprint, -fingerprint], dtype=np.int64)


class Attempt:
    """One rank's part in one attempt, one step at a time (the model
    checker in the tests drives these same steps in every order)."""

    def __init__(self, store: Any, namespace: str, rank: int, ranks: tuple[int, ...],
                 descriptor: dict[str, Any], attempt: int) -> None:
        self.store, self.namespace, self.rank, self.ranks = store, namespace, rank, ranks
        self.descriptor, self.attempt = descriptor, attempt

    def publish(self) -> None:
        mine = json.dumps(self.descriptor, sort_keys=True)
        self.store.compare_set(_published(self.namespace, self.attempt, self.rank), "", mine)

    def look(self, expired: bool) -> dict[str, Any] | None:
        """One look at the attempt: decide it if this rank can (every rank
        published, or `expired`: this rank's deadline passed); the decision
        once there is one."""
        store, namespace, attempt = self.store, self.namespace, self.attempt
        if (decision := _read_decision(store, namespace, attempt)) is not None:
            return decision
        theirs = {r: _read(store, _published(namespace, attempt, r)) for r in self.ranks}
        if all(t is not None for t in theirs.values()):
            if len(set(theirs.values())) == 1:
                _decide(store, namespace, attempt, {"outcome": ATTACHED})
            else:
                _decide(store, namespace, attempt, {"outcome": DIFFER, "descriptors": {
                    str(r): json.loads(t) for r, t in theirs.items() if t is not None}})
        elif expired:
            _decide(store, namespace, attempt, {
                "outcome": MISSING, "ranks": sorted(r for r, t in theirs.items() if t is None)})
        else:
            return None
        return _read_decision(store, namespace, attempt)


def _read(store: Any, key: str) -> str | None:
    if not store.check([key]):
        return None
    return bytes(store.get(key)).decode()


def _read_decision(store: Any, namespace: str, attempt: int) -> dict[str, Any] | None:
    raw = _read(store, _decision(namespace, attempt))
    return json.loads(raw) if raw else None


def _decide(store: Any, namespace: str, attempt: int, decision: dict[str, Any]) -> None:
    """Write the decision unless a peer wrote one first (then theirs holds),
    and raise the decided mark so that later attaches join a later attempt."""
    store.compare_set(_decision(namespace, attempt), "", json.dumps(decision, sort_keys=True))
    key = _decided(namespace)
    while (decided := int(store.add(key, 0))) < attempt:
        store.compare_set(key, str(decided), str(attempt))


def follow(decision: dict[str, Any], rank: int, descriptor: dict[str, Any], timeout_s: float) -> None:
    outcome = decision["outcome"]
    if outcome == ATTACHED:
        return
    if outcome == MISSING:
        missing = decision["ranks"]
        if rank in missing:  # this rank published after a peer's deadline: the attempt is over for all
            raise Unavailable(f"attach: ranks {missing} did not attach within {timeout_s:.0f}s of a peer "
                              f"(this one among them); nothing was attached on any rank: attach again on every "
                              f"rank")
        raise Unavailable(f"attach: ranks {missing} did not attach within {timeout_s:.0f}s; nothing was attached "
                          f"on any rank: every rank of the domain must attach the same pool")
    differ = {int(r): d for r, d in decision["descriptors"].items() if d != descriptor}
    fields = sorted(k for k in descriptor if any(d.get(k) != descriptor[k] for d in differ.values()))
    listing = "; ".join(f"ranks [{r}]: " + ", ".join(f"{k}={d.get(k)!r}" for k in fields)
                        for r, d in sorted(differ.items()))
    raise FailedPrecondition(
        f"attach: the ranks differ in {', '.join(fields)} (ranks [{rank}]: "
        + ", ".join(f"{k}={descriptor[k]!r}" for k in fields) + f"; {listing}); nothing was attached")
