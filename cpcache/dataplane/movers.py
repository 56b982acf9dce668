"""Movers: one per (source tier, destination tier), registered in a table so
a new tier adds entries without touching the dispatcher.

A transfer is a job with an id; it runs on an I/O thread and ends with a
`TransferResult` (success, and how many pages, from the first, are done).
While a job runs, its host slots are counted in flight (docs/design.md rule 5).

A job belongs to the session it was issued in and carries the device pool
bound then (docs/design.md rule 10): a mover never looks up "the current pool" when
the job runs. A storage job whose session ended before it started is
refused; a device <-> host copy issued while its session was open runs to
its end (a forward may be reading the load, docs/design.md rule 12), and whoever
hands the pool on waits for it (counted).

Three lanes, each its own threads: load-backs (host -> device: a forward
waits on them layer by layer, so they never queue behind write-throughs),
write-throughs (device -> host), storage calls (a store that hangs delays
only storage work). At shutdown the copies of both copy lanes are finished
(`finish_copies`, bounded), storage work not started is cancelled.

The movers themselves: `device_copies.py` (device <-> host) and
`storage_copies.py` (host <-> storage); a job, its result and the tiers:
`transfer_jobs.py` (`Tiers`, `TransferJob` and `TransferResult` are
importable from here too, as the data plane's callers always have).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from cpcache.dataplane.copy_faults import CopyFaultInjector, CopyFaults
from cpcache.dataplane.device_copies import device_to_host, host_to_device
from cpcache.dataplane.inflight import InFlight
from cpcache.dataplane.sessions import Session
from cpcache.dataplane.storage_copies import host_to_storage, storage_to_host
from cpcache.dataplane.transfer_jobs import Tiers, TransferJob, TransferResult
from cpcache.errors import InvalidArgument

log = logging.getLogger(__name__)

DEVICE, HOST, STORAGE = "device", "host", "storage"

T = TypeVar("T")


# (source tier, destination tier) -> mover
MOVERS = {
    (DEVICE, HOST): device_to_host,
    (HOST, DEVICE): host_to_device,
    (HOST, STORAGE): host_to_storage,
    (STORAGE, HOST): storage_to_host,
}


def touches_device(route: tuple[str, str]) -> bool:
    return DEVICE in route


def host_slots(route: tuple[str, str], job: TransferJob) -> tuple[int, ...]:
    """The host slots a job reads or writes."""
    return job.dst if route[1] == HOST else job.src


def _signal_failure(job: TransferJob) -> None:
    """A load-back that will not land: its forward must stop, not wait."""
    slot, op = job.signal
    if slot and job.device is not None and job.device.signals is not None:
        job.device.signals.fail(slot, op)


@dataclass(frozen=True)
class Finished:
    """What `Transfers.finish_copies` saw: the copies it waited for, and of
    those, the ones still running at its deadline (stuck: left to the exit)
    and the ones not started by then (cancelled, their loads published FAILED)."""

    waited: int
    running: int = 0
    cancelled: int = 0


class Transfers:
    """Runs jobs on I/O threads, counting their host slots in flight."""

    def __init__(self, tiers: Tiers, threads: int = 4, in_flight: InFlight | None = None,
                 copy_faults: CopyFaults = CopyFaults()) -> None:
        """`threads` per lane (load-backs, write-throughs, storage calls):
        a store that hangs delays only storage work, and a load-back never
        waits behind a write-through."""
        self.tiers = tiers
        self.in_flight = in_flight or InFlight()
        self._loads = ThreadPoolExecutor(threads, thread_name_prefix="cpcache-load")
        self._copies = ThreadPoolExecutor(threads, thread_name_prefix="cpcache-copy")
        self._storage = ThreadPoolExecutor(threads, thread_name_prefix="cpcache-storage")
        self._copying: set[Future] = set()  # device <-> host copies issued and not ended: finished at shutdown
        self._lanes_lock = threading.Lock()  # a copy is submitted and counted, or refused: never missed by a stop
        self._counters_lock = threading.Lock()  # I/O threads count, the metrics thread reads
        self._copy_faults = CopyFaultInjector(copy_faults) if copy_faults.active else None
        self._ids = itertools.count(1)
        self.pages_moved: dict[tuple[str, str], int] = {route: 0 for route in MOVERS}
        self.bytes_moved: dict[tuple[str, str], int] = {route: 0 for route in MOVERS}
        self.failed_jobs: dict[tuple[str, str], int] = {route: 0 for route in MOVERS}
        # Jobs of an ended session refused before they touched anything.
        self.refused_jobs: dict[tuple[str, str], int] = {route: 0 for route in MOVERS}

    def submit(self, route: tuple[str, str], src: Sequence[int | str], dst: Sequence[int | str],
               job_id: int | None = None, session: Session | None = None,
               signal: tuple[int, int] = (0, 0)) -> Future:
        """Start a job of `session` (None: a job of no session, bound to
        `tiers.device` now); its future resolves to a TransferResult (a
        failure inside the mover, or a refusal, is a failed result, not an
        exception). `signal`: a load-back's (slot, op id) on the device
        pool's load-signal board, where its layers are published (a failure
        or a refusal too, so that no forward waits for it in vain)."""
        if route not in MOVERS:
            raise InvalidArgument(f"no mover from {route[0]} to {route[1]}")
        if len(src) != len(dst):
            raise InvalidArgument(f"a transfer needs as many sources as destinations, got {len(src)} and {len(dst)}")
        device = (session.device if session is not None else self.tiers.device) if touches_device(route) else None
        layer_faults = self._copy_faults.layer_faults() if self._copy_faults is not None and route == (HOST, DEVICE) \
            else None
        job = TransferJob(tuple(src), tuple(dst), job_id if job_id is not None else next(self._ids), device,
                          signal, layer_faults)
        slots = list(host_slots(route, job))
        self.in_flight.begin(slots)
        issued_open = session.issue(touches_device(route)) if session is not None else True
        # A copy issued while its session was open runs to its end, ended session or not.
        finish = touches_device(route) and issued_open
        executor = self._lane(route)
        try:
            with self._lanes_lock:
                future = executor.submit(self._run, route, job, slots, session, finish)
                if touches_device(route):
                    self._copying.add(future)
        except RuntimeError:  # shut down: a failed transfer, not an exception on the loop
            self.in_flight.end(slots)
            self._given_up(job)
            future = Future()
            future.set_result(TransferResult(job.job_id, False, 0))
        else:
            if touches_device(route):
                future.add_done_callback(self._copy_ended)
        if session is not None:
            # Counted until it has run, been refused or been cancelled (at shutdown).
            future.add_done_callback(lambda _: session.job_ended(touches_device(route)))
        future.add_done_callback(lambda f: self._cancelled(f, job, slots))
        return future

    def _cancelled(self, future: Future, job: TransferJob, slots: list[int]) -> None:
        """A job cancelled at shutdown never ran: its slots are idle again,
        and a load's forward must not wait for it in vain."""
        if future.cancelled():
            self.in_flight.end(slots)
            self._given_up(job)

    def _given_up(self, job: TransferJob) -> None:
        """A load this daemon will not copy (it stops): where the scheduler
        maps the host pool, its forward finishes the load itself once this
        process has exited, so the board is left as it is (FAILED would stop
        that forward while the process still runs); elsewhere FAILED, so
        the forward stops at once instead of waiting in vain."""
        if self.tiers.host.fd < 0:
            _signal_failure(job)

    def _lane(self, route: tuple[str, str]) -> ThreadPoolExecutor:
        if STORAGE in route:
            return self._storage
        return self._loads if route == (HOST, DEVICE) else self._copies

    def _copy_ended(self, future: Future) -> None:
        with self._lanes_lock:
            self._copying.discard(future)

    def run_storage_call(self, fn: Callable[[], T]) -> Future[T]:
        """Run a blocking storage call that is not a transfer (a lookup).
        While shutting down, the call is not run and its future fails."""
        try:
            return self._storage.submit(fn)
        except RuntimeError as exc:
            failed: Future[T] = Future()
            failed.set_exception(exc)
            return failed

    def counters(self) -> dict[str, dict[tuple[str, str], int]]:
        with self._counters_lock:
            return {"pages_moved": dict(self.pages_moved), "bytes_moved": dict(self.bytes_moved),
                    "failed_jobs": dict(self.failed_jobs), "refused_jobs": dict(self.refused_jobs)}

    def _run(self, route: tuple[str, str], job: TransferJob, slots: list[int],
             session: Session | None = None, finish: bool = False) -> TransferResult:
        if session is not None and not session.admit(finish):
            # Issued in a session that has ended (a late round, a queue that
            # outlived a drain): it must not land in what comes after.
            self.in_flight.end(slots)
            log.warning("transfer %d (%s -> %s) of ended %r refused", job.job_id, *route, session)
            _signal_failure(job)
            with self._counters_lock:
                self.refused_jobs[route] += 1
                self.failed_jobs[route] += 1
            return TransferResult(job.job_id, False, 0)
        try:
            if STORAGE not in route and self._copy_faults is not None and not self._copy_faults.before_copy():
                result = TransferResult(job.job_id, False, 0)  # an injected copy failure: nothing copied
            else:
                result = MOVERS[route](self.tiers, job)
        except Exception:  # a broken backend is a failed transfer, never a dead thread
            log.exception("transfer %d (%s -> %s) failed", job.job_id, *route)
            result = TransferResult(job.job_id, False, 0)
        finally:
            self.in_flight.end(slots)
        if not result.success:
            _signal_failure(job)
        with self._counters_lock:
            self.pages_moved[route] += result.pages_done
            self.failed_jobs[route] += not result.success
            self.bytes_moved[route] += result.pages_done * self.tiers.host.geometry.page_bytes
        return result

    def finish_copies(self, timeout_s: float) -> Finished:
        """Stop taking jobs, cancel the storage work not started (no forward
        reads it), and wait up to `timeout_s` for every device <-> host copy
        already issued to end: a forward may be reading a load as it lands,
        and a write-through was acknowledged. Copies not started by then are
        cancelled (a load among them is published FAILED, so its forward
        stops instead of waiting); a copy still running is stuck (a broken
        device) and is left to the exit."""
        with self._lanes_lock:
            for lane in (self._loads, self._copies, self._storage):
                lane.shutdown(wait=False)
            copying = set(self._copying)
        self._storage.shutdown(wait=False, cancel_futures=True)
        _, left = concurrent.futures.wait(copying, max(0.0, timeout_s))
        cancelled = sum(future.cancel() for future in left)
        return Finished(len(copying), len(left) - cancelled, cancelled)

    def close(self) -> None:
        """Stop taking jobs; cancel those not started (`finish_copies` first
        for a graceful stop); do not wait for a storage call that hangs (the
        daemon exits regardless)."""
        for lane in (self._loads, self._copies, self._storage):
            lane.shutdown(wait=False, cancel_futures=True)
        if self.tiers.storage is not None:
            self.tiers.storage.close()
        self.tiers.host.close()
