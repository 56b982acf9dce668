"""When a rank that fell back to SGLang's device tree tries to attach to its
daemon again: at the same scheduler iterations on every rank.

Iterations are counted (`check_hicache_events` calls, alike on every rank),
never timed. The tries fall on absolute iterations, multiples of the
current wait, not on ones counted from this rank's own fallback, so ranks
that fell back apart (a daemon lost where no peer could tell how its step
ended) try at the same ones; each failed try doubles the wait (up to 64
times the first), so ranks whose waits differ still meet: every try of a
rank whose wait doubled falls on a try of the others (the waits are powers
of two of one base). A try while a daemon of the domain is not serving yet
is skipped, its wait kept. Attach is agreed, so every rank is attached
again at the same try, or none is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cpcache.client.session import SchedulerSession
from cpcache.errors import CacheError, Unavailable

log = logging.getLogger(__name__)
LONGEST_WAIT = 64  # times the first wait


class NotServingYet(Unavailable):
    """A daemon of the domain is not serving: an attach try now cannot
    succeed on any rank (it needs every one), so it is skipped."""


class AttachAgain:
    def __init__(self, rank: int, attach: Callable[[], SchedulerSession] | None, after: int) -> None:
        """`attach`: a new session of the rank's daemon (None: never attach
        again); `after`: iterations between a fallback and the first try."""
        self.rank = rank
        self._attach = attach
        self._after = max(1, after)
        self.iteration = 0  # scheduler iterations: alike on every rank
        self.next_try: int | None = None  # the iteration of the next try while fallen back
        self._wait = self._after
        self._skips = 0  # tries skipped since the last attach (a daemon not serving)

    @property
    def possible(self) -> bool:
        return self._attach is not None

    def fell_back(self) -> None:
        """The daemon was left at this iteration: the first try is due after
        the first wait."""
        self._wait = self._after
        self.next_try = self._boundary() if self._attach is not None else None

    def due(self) -> bool:
        return self.next_try is not None and self.iteration >= self.next_try

    def _boundary(self) -> int:
        """The next iteration that is a multiple of the current wait."""
        return (self.iteration // self._wait + 1) * self._wait

    def attempt(self) -> SchedulerSession | None:
        """Try to attach now: -> the new session, or None (no rank attached;
        the next try is scheduled)."""
        assert self._attach is not None
        try:
            session = self._attach()
        except NotServingYet as exc:
            # Skipped, not tried: the wait stays.
            self.next_try = self._boundary()
            self._skips += 1
            if self._skips & (self._skips - 1) == 0:  # the 1st, 2nd, 4th, ...: a log that grows slowly
                log.info("cpcache: rank %d skipped attaching again at iteration %d (%s; %d skips); next try at "
                         "iteration %d", self.rank, self.iteration, exc, self._skips, self.next_try)
            return None
        except (CacheError, OSError) as exc:
            # A CacheError is the daemon's answer; an OSError is this side's
            # (a descriptor or a memfd not had, before the Attach): either
            # way no rank attached, and this one stays on its device tree.
            self._wait = min(self._wait * 2, LONGEST_WAIT * self._after)
            self.next_try = self._boundary()
            log.warning("cpcache: rank %d could not attach again at iteration %d (%s); next try in %d iterations",
                        self.rank, self.iteration, exc, self._wait, exc_info=not isinstance(exc, CacheError))
            return None
        self.next_try = None
        self._skips = 0
        return session
