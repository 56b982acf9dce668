"""The scheduler session's side of prefetch holds (`SchedulerSession`): which
steps carry a release, for every way a request lets go of its prefetched
pages. Driven by hand: each step taken with `next_step`, each reply built
as an agreed domain would send it."""

from __future__ import annotations

import pytest

from cpcache.client.messages import StepResult
from cpcache.client.session import SchedulerSession

pytestmark = pytest.mark.timeout(10)

PAGES = [bytes([n]) * 32 for n in range(1, 4)]


def reply(step: int, **decided: object) -> StepResult:
    return StepResult(step, step, {}, 0, b"", **decided)  # type: ignore[arg-type]


def ended(session: SchedulerSession, rid: str, pages: int, hold: bool = True) -> int:
    """A prefetch for `rid`, carried by a step and ended by its reply with `pages` pages."""
    op = session.prefetch(PAGES, 48, rid=rid, hold=hold)
    step, requests = session.next_step()
    assert [p.hold for p in requests.prefetches] == [hold]
    session.follow(reply(step, prefetch_done={op: pages}))
    assert session.prefetch_ended(rid) and session.take_prefetched(rid) == pages
    return op


def releases(session: SchedulerSession) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(revokes, hold releases) of the next step."""
    _, requests = session.next_step()
    return requests.revokes, requests.hold_releases


def test_a_held_prefetch_is_released_once_by_release_hold():
    s = SchedulerSession()
    op = ended(s, "a", 3)
    s.release_hold("a")
    s.release_hold("a")  # once is enough
    assert releases(s) == ((), (op,))
    s.release("a")  # the request finishes later: nothing more to say
    assert releases(s) == ((), ())


def test_an_aborted_request_releases_its_hold():
    s = SchedulerSession()
    op = ended(s, "a", 3)
    s.release("a")
    assert releases(s) == ((), (op,))


def test_a_release_racing_the_end_is_a_revoke():
    s = SchedulerSession()
    op = s.prefetch(PAGES, 48, rid="a", hold=True)
    s.next_step()  # carried; the daemon may end it before it learns of the abort
    s.release("a")
    assert releases(s) == ((op,), ())  # a revoke that finds it ended releases its hold


def test_nothing_held_nothing_released():
    s = SchedulerSession()
    ended(s, "revoked", 0)
    ended(s, "unheld", 3, hold=False)
    for rid in ("revoked", "unheld", "unknown"):
        s.release_hold(rid)
        s.release(rid)
    assert releases(s) == ((), ())


def test_a_flush_releases_every_hold_and_a_step_no_rank_took_carries_them_again():
    s = SchedulerSession()
    ops = [ended(s, rid, 2) for rid in ("a", "b")]
    s.release_holds()
    _, requests = s.next_step()
    assert requests.hold_releases == tuple(ops)
    s.not_taken(requests)
    assert releases(s) == ((), tuple(ops))
