"""Blocking calls bounded by the wall clock: the one deadline helper.

torch's TCPStore client does not honour its timeout against a server that
is stopped or black-holed (the connection stays open and nothing answers),
and a storage backend can hang the same way: a call can block for as long
as the other side stays away. The diagnosis of a lost peer, an Attach, a
Match and the daemon's exit must answer in bounded time, so their calls run
on another thread and are abandoned at the deadline (the thread ends
whenever the call returns).

`bounded` waits from a plain thread, `bounded_async` from the event loop.
The call runs on a daemon thread of its own, or where `bounded_async` is
told (an executor's `submit`: a call still queued there is dropped at the
deadline). Unlike `asyncio.to_thread`, a daemon thread holds neither the
loop's close nor the process's exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable
from typing import TypeVar

from cpcache.abandonable import on_daemon_thread

T = TypeVar("T")


class StoreTimeout(RuntimeError):
    """The call did not answer within the deadline (a RuntimeError, as the
    store client's own failures are)."""


def _timed_out(what: str, timeout_s: float) -> StoreTimeout:
    return StoreTimeout(f"{what} had no answer within {timeout_s:.1f}s (the store is stopped or unreachable)")


def bounded(fn: Callable[[], T], timeout_s: float, what: str = "a rendezvous store call") -> T:
    """`fn()`, or `StoreTimeout` once `timeout_s` has passed."""
    job = on_daemon_thread(fn, "store-call")
    try:
        return job.result(max(0.0, timeout_s))
    except concurrent.futures.TimeoutError:
        if job.done():  # the call's own TimeoutError (or it ended right at the deadline)
            return job.result()
        raise _timed_out(what, timeout_s) from None


async def bounded_async(fn: Callable[[], T], timeout_s: float | None, what: str,
                        start: Callable[[Callable[[], T]], concurrent.futures.Future[T]] | None = None) -> T:
    """`fn()` off the loop, awaited: `StoreTimeout` once `timeout_s` has
    passed (None: no deadline but the call's own; the call still holds
    neither the loop's close nor the exit). `start`: how the call is
    started (an executor's `submit`); a daemon thread named `what` if None."""
    job = start(fn) if start is not None else on_daemon_thread(fn, what)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def finish() -> None:
        if not done.done():  # cancelled: nobody waits for it any more
            done.set_result(None)

    def tell(_: concurrent.futures.Future[T]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon has stopped
            loop.call_soon_threadsafe(finish)

    job.add_done_callback(tell)
    try:
        await asyncio.wait_for(done, timeout_s)
    except TimeoutError:
        job.cancel()  # a call still queued is dropped; a running one is abandoned
        raise _timed_out(what, timeout_s or 0.0) from None
    return job.result()
