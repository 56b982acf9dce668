"""A deadline on each call a decode server's offload makes into the store.

SGLang calls the storage backend from its backup thread and waits for the
answer; a store that stops answering (a Mooncake master stopped, a hung
mount) would stall that thread, and every backup behind it, for as long as
the store stays away. So each call runs on a thread of its own
(`cpcache.abandonable`) and is given up at the domain's
`storage_timeout_s`: a write given up is a failed backup, a lookup or a read
a miss, logged. While a given-up call has not returned, the next calls fail
at once, without waiting again; the first to return ends that.

A call given up may still be running: it never touches SGLang's host slots
after its caller stopped waiting (`CallGuard`), since SGLang may have
handed them to other pages by then; its own staging memory is the store's
to finish with.

No SGLang import here: `storage.CpcacheStore` wraps its calls in this.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from cpcache.abandonable import on_daemon_thread

log = logging.getLogger(__name__)
T = TypeVar("T")


class CallGuard:
    """Whether a call's caller still waits for it. A call checks it around
    each touch of SGLang's host slots, under the lock the caller takes to
    give up: once given up, no slot is read or written by the call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waited = True

    @contextlib.contextmanager
    def host_slots(self) -> Iterator[bool]:
        """True: the caller waits, the slots may be touched until the block ends."""
        with self._lock:
            yield self._waited

    def give_up(self) -> None:
        with self._lock:
            self._waited = False


class BoundedCalls:
    """Calls into the store, each answered within `timeout_s` (a miss past it)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._overdue = 0  # calls given up that have not returned yet
        self._answered = threading.Condition(self._lock)
        self.timed_out = 0  # calls given up at their deadline
        self.skipped = 0  # calls failed at once while one given up had not returned

    @property
    def stalled(self) -> bool:
        with self._lock:
            return self._overdue > 0

    def wait_answered(self, timeout_s: float) -> bool:
        """Wait until no call given up is still running: -> whether none is."""
        with self._answered:
            return self._answered.wait_for(lambda: self._overdue == 0, timeout_s)

    def call(self, what: str, fn: Callable[[CallGuard], T], miss: T) -> T:
        """`fn(guard)`, or `miss` if it has not answered within the deadline
        (or a call given up earlier has not returned yet); `what` names the
        call in the log (e.g. "a write of 4 pages")."""
        with self._lock:
            if self._overdue:
                self.skipped += 1
                log.debug("cpcache: %s not tried: the store has not answered a call given up on", what)
                return miss
        guard = CallGuard()
        job = on_daemon_thread(lambda: fn(guard), "cpcache-store-call")
        try:
            return job.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            guard.give_up()
            if job.done() and job.exception() is None:
                return job.result()  # it returned at the deadline: its answer stands
        with self._lock:
            self._overdue += 1
            self.timed_out += 1
        log.warning("cpcache: the store did not answer %s within storage_timeout_s (%g s): counted as a miss "
                    "(a write: a failed backup); the next calls fail at once until it answers", what,
                    self.timeout_s)
        job.add_done_callback(lambda done: self._returned(what, done))
        return miss

    def _returned(self, what: str, job: concurrent.futures.Future) -> None:
        with self._answered:
            self._overdue -= 1
            self._answered.notify_all()
        failure = job.exception()  # nobody waits for it any more: said here, or never
        log.warning("cpcache: the store answered %s given up on%s; calls into it go on", what,
                    f" (it failed: {failure!r})" if failure is not None else "")
