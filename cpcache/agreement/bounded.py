"""Calls to the rendezvous store bounded by the wall clock.

torch's TCPStore client does not honour its timeout against a server that
is stopped or black-holed (the connection stays open and nothing answers):
a call can block for as long as the server stays away. The agreement
thread's diagnosis of a lost peer and an Attach must answer in bounded
time, so their store calls run on a helper thread and are abandoned at the
deadline (the thread ends whenever the store answers or goes)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class StoreTimeout(RuntimeError):
    """The store did not answer within the deadline (a RuntimeError, as the
    store client's own failures are)."""


def bounded(fn: Callable[[], T], timeout_s: float, what: str = "a rendezvous store call") -> T:
    outcome: list = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # handed to the caller
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name="store-call", daemon=True).start()
    if not done.wait(max(0.0, timeout_s)):
        raise StoreTimeout(f"{what} had no answer within {timeout_s:.1f}s (the store is stopped or unreachable)")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
