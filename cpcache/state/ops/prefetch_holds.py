"""Holds: an ended prefetch's pages kept from eviction until its request
loads them.

A scheduler asks whether a waiting request's prefetch may end when the
request comes up for admission, and the request may wait on after that (a
full batch, a spent token budget). Meanwhile the write-throughs of the
requests admitted ahead of it make room in the host pool, and eviction
takes its prefetched pages first, tail first, as the least recently used:
the storage read is lost and the request computes those pages. A hold
keeps them, like an operation's reference but with no I/O behind it, until
the scheduler releases it (its request loaded them, was admitted without
them, or is gone: a step's `hold_releases`, or a revoke that finds the
prefetch ended), or until `HOLD_STEPS` steps have passed, so that a
scheduler that forgets one costs a bounded number of steps.

Holds keep at most `prefetch_hold_share` of the pool's pages (a page held
by two prefetches counts once), so that write-throughs keep the rest: a
prefetch that ends at that cap holds what fits, from its first page
(eviction takes a chain's tail first, so the held head stays a prefix
hit). A held page also keeps its chain's pages before it, which eviction
takes only after it: those are not counted."""

from __future__ import annotations

from cpcache.state.ledger import Hold, Ledger

HOLD_STEPS = 20_000  # a request waits far fewer steps for its admission


def hold(ledger: Ledger, op_id: int, pages: list[bytes]) -> None:
    """Keep resident `pages` (a chain, from its first page) for prefetch
    `op_id`: as many as the cap lets, a page held already costing nothing."""
    release(ledger, op_id)  # a scheduler may use an ended prefetch's id again
    room = ledger.hold_cap - ledger.held_pages
    held: list[bytes] = []
    for page in pages:
        entry = ledger.index[page]
        if not entry.held:
            if room <= 0:
                break
            room -= 1
            ledger.held_pages += 1
        entry.held += 1
        held.append(page)
    if held:
        ledger.holds_taken += 1
        ledger.holds[op_id] = Hold(ledger.step, tuple(held))
        ledger.record("hold", op_id, len(held))


def release(ledger: Ledger, op_id: int) -> None:
    """Prefetch `op_id`'s request no longer needs its pages kept (no-op if none are)."""
    if (held := ledger.holds.pop(op_id, None)) is not None:
        _drop(ledger, held)
        ledger.record("release hold", op_id)


def expire(ledger: Ledger) -> None:
    """Release the holds older than `HOLD_STEPS` steps (they end in step order)."""
    holds = ledger.holds
    while holds:
        op_id, held = next(iter(holds.items()))
        if ledger.step - held.step < HOLD_STEPS:
            return
        del holds[op_id]
        _drop(ledger, held)
        ledger.holds_expired += 1
        ledger.record("hold expired", op_id)


def _drop(ledger: Ledger, held: Hold) -> None:
    # A held page cannot be evicted: every one is still resident.
    for page in held.pages:
        entry = ledger.index[page]
        entry.held -= 1
        ledger.held_pages -= not entry.held
