"""Ending a cache's I/O, bounded: the copies it issued between device and
host let finish, its storage closed. Neither holds the caller when it hangs:
used when an epoch's caches close (`rank/epochs.py`) and when an Attach
gives up the cache kept apart (`rank/attach.py`)."""

from __future__ import annotations

import functools
import logging

from cpcache.agreement.bounded import StoreTimeout, bounded_async
from cpcache.rank.assembly import CacheRuntime

log = logging.getLogger("cpcached")

CLOSE_S = 5.0  # the longest closing a storage backend may hold the exit


async def close_storage(runtime: CacheRuntime, what: str) -> None:
    """Close a cache's storage; one that hangs does not hold the caller."""
    try:
        await bounded_async(runtime.io.close, CLOSE_S, what)
    except StoreTimeout:
        log.warning("%s did not finish within %.0fs; going on without it", what, CLOSE_S)


async def finish_copies(runtime: CacheRuntime, timeout_s: float) -> None:
    """Let a cache's copies issued so far end, for up to `timeout_s`; say
    what was left (`Transfers.finish_copies`)."""
    timeout_s = max(0.0, timeout_s)
    finished = await bounded_async(functools.partial(runtime.io.finish_copies, timeout_s), None, "finish-copies")
    if finished.running or finished.cancelled:
        log.warning("of %d copies between device and host, %d were still running after %.1fs (stuck: left to the "
                    "exit) and %d not started were given up (their loads published failed)", finished.waited,
                    finished.running, timeout_s, finished.cancelled)
    elif finished.waited:
        log.info("finished the %d copies between device and host issued before the stop", finished.waited)
