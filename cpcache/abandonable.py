"""A call on a daemon thread of its own, whose caller may stop waiting for it:
the thread ends whenever the call returns, and holds neither an event loop's
close nor the process's exit (unlike `asyncio.to_thread`). The deadlines
built on it: `cpcache.agreement.bounded` (the rendezvous store, storage in
the daemon) and `cpcache.integrations.sglang.store_calls` (a decode
server's offload)."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_daemon_thread(fn: Callable[[], T], name: str = "bounded-call") -> concurrent.futures.Future[T]:
    """Start `fn` on a daemon thread of its own; its outcome in a future."""
    job: concurrent.futures.Future[T] = concurrent.futures.Future()
    job.set_running_or_notify_cancel()  # running from now on: never cancelled, only abandoned

    def run() -> None:
        try:
            job.set_result(fn())
        except BaseException as exc:  # handed to whoever waits
            job.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return job
