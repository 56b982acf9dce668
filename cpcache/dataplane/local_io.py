"""This rank's side of the cache: runs the I/O the shared state asks for and
keeps its progress as the local answers of the next rounds.

One door from I/O threads to the loop: a mover's completion only puts an
event on a queue; `drain` (called on the loop when a round is packed) folds
the events into the progress tables. Nothing else touches them, so no table
is ever written from two threads.
"""

from __future__ import annotations

import collections
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

from cpcache.dataplane.movers import DEVICE, HOST, STORAGE, Finished, TransferResult, Transfers
from cpcache.dataplane.pools import DevicePool
from cpcache.dataplane.sessions import Session
from cpcache.dataplane.storage import StorageBackend
from cpcache.state.intents import CopyToDevice, CopyToHost, Fetch, Intent, Lookup, Store
from cpcache.state.questions import NOT_YET, BackupOutcome, CopyOutcome

FETCH_CHUNK_PAGES = 16  # a fetch reports progress chunk by chunk
LOAD_JOBS_KEPT = 1 << 16  # finished loads WaitLoads still knows
T = TypeVar("T")


@dataclass
class FetchProgress:
    started: float
    chunks: list[int]  # pages per chunk, in order
    done: list[int | None] = field(default_factory=list)  # pages done per finished chunk, by index
    finished: int = 0

    def prefix(self) -> int:
        total = 0
        for size, done in zip(self.chunks, self.done):
            if done is None:
                return total
            total += done
            if done < size:
                return total
        return total


class LocalIO:
    def __init__(self, transfers: Transfers, storage_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`storage_timeout_s`: a storage call that has not answered by then
        counts as a miss (a lookup) or a timed-out write (a backup) here, so
        a hung store never holds an operation open."""
        self.transfers = transfers
        # The session this I/O is issued in: none (every job refused) until
        # the scheduler's attach opens one, and ended when it ends.
        self.session = _ended_session()
        self._clock = clock
        self._storage_timeout_s = storage_timeout_s
        self._events: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._exists: dict[int, tuple[int, float]] = {}  # serial -> (pages or NOT_YET, asked at)
        self._fetches: dict[int, FetchProgress] = {}
        self._writes: dict[int, CopyOutcome] = {}
        self._backups: dict[int, tuple[BackupOutcome, float]] = {}  # serial -> (outcome, started)
        self._loads: dict[int, CopyOutcome] = {}
        # The scheduler's load op id -> this rank's copy; kept after the load
        # closes, so a WaitLoads after the step that reported it still answers.
        self._load_jobs: collections.OrderedDict[int, Future] = collections.OrderedDict()

    @property
    def storage_timeout_s(self) -> float:
        return self._storage_timeout_s

    @property
    def has_storage(self) -> bool:
        return self.transfers.tiers.storage is not None

    def _post(self, event: Callable[[], None]) -> None:
        """From any thread: an update for the loop to apply in `drain`."""
        self._events.put(event)

    def drain(self) -> None:
        """On the loop: apply every I/O event that has arrived."""
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            event()

    # -- starting I/O ------------------------------------------------------------

    def start(self, intents: list[Intent]) -> None:
        for intent in intents:
            match intent:
                case Lookup():
                    self._lookup(intent)
                case Fetch():
                    self._fetch(intent)
                case CopyToHost():
                    self._copy_to_host(intent)
                case Store():
                    self._store(intent)
                case CopyToDevice():
                    self._copy_to_device(intent)

    def _lookup(self, intent: Lookup) -> None:
        if not self.has_storage:
            self._exists[intent.serial] = (0, self._clock())
            return
        self._exists[intent.serial] = (NOT_YET, self._clock())
        storage = self.transfers.tiers.storage
        assert storage is not None  # has_storage

        def ask() -> None:
            try:
                found = storage.exists_prefix(list(intent.keys))
            except Exception:  # storage down: an agreed miss, not a dead thread
                found = 0
            self._post(lambda: self._found(intent.serial, found))

        self.transfers.run_storage_call(ask)

    def _found(self, serial: int, pages: int) -> None:
        if serial in self._exists:
            self._exists[serial] = (pages, self._exists[serial][1])

    def _fetch(self, intent: Fetch) -> None:
        n = len(intent.keys)
        sizes = [min(FETCH_CHUNK_PAGES, n - i) for i in range(0, n, FETCH_CHUNK_PAGES)]
        progress = FetchProgress(self._clock(), sizes, [None] * len(sizes))
        self._fetches[intent.serial] = progress
        for index, first in enumerate(range(0, n, FETCH_CHUNK_PAGES)):
            span = slice(first, first + FETCH_CHUNK_PAGES)
            job = self.transfers.submit((STORAGE, HOST), intent.keys[span], intent.slots[span],
                                        session=self.session)

            def done(f: Future, i: int = index) -> None:
                self._post(lambda: self._fetched(progress, i, _result(f)))

            job.add_done_callback(done)

    @staticmethod
    def _fetched(progress: FetchProgress, index: int, result: TransferResult) -> None:
        progress.done[index] = result.pages_done
        progress.finished += 1

    def _copy_to_host(self, intent: CopyToHost) -> None:
        self._writes[intent.serial] = CopyOutcome.PENDING
        job = self.transfers.submit((DEVICE, HOST), intent.device_pages, intent.slots, session=self.session)
        job.add_done_callback(lambda f: self._post(lambda: self._ended(self._writes, intent.serial, _result(f))))

    def _store(self, intent: Store) -> None:
        if not intent.keys:
            # Not this rank's pages to write: done here, still part of the agreed answer.
            self._backups[intent.serial] = (BackupOutcome.STORED, self._clock())
            return
        if not self.has_storage:
            self._backups[intent.serial] = (BackupOutcome.FAILED, self._clock())
            return
        self._backups[intent.serial] = (BackupOutcome.PENDING, self._clock())
        job = self.transfers.submit((HOST, STORAGE), intent.slots, intent.keys, session=self.session)

        def stored(f: Future) -> None:
            outcome = BackupOutcome.STORED if _result(f).success else BackupOutcome.FAILED
            self._post(lambda: self._backed_up(intent.serial, outcome))

        job.add_done_callback(stored)

    def _backed_up(self, serial: int, outcome: BackupOutcome) -> None:
        if serial in self._backups:
            self._backups[serial] = (outcome, self._backups[serial][1])

    def _copy_to_device(self, intent: CopyToDevice) -> None:
        self._loads[intent.serial] = CopyOutcome.PENDING
        job = self.transfers.submit((HOST, DEVICE), intent.slots, intent.device_pages, session=self.session,
                                    signal=(intent.signal_slot, intent.op_id))
        self._load_jobs[intent.op_id] = job
        self._load_jobs.move_to_end(intent.op_id)
        while len(self._load_jobs) > LOAD_JOBS_KEPT:
            self._load_jobs.popitem(last=False)
        job.add_done_callback(lambda f: self._post(lambda: self._ended(self._loads, intent.serial, _result(f))))

    @staticmethod
    def _ended(table: dict[int, CopyOutcome], serial: int, result: TransferResult) -> None:
        if serial in table:
            table[serial] = CopyOutcome.OK if result.success else CopyOutcome.FAILED

    # -- LocalProgress ------------------------------------------------------------

    def exists(self, serial: int) -> int:
        found, asked_at = self._exists.get(serial, (NOT_YET, self._clock()))
        if found == NOT_YET and self._clock() - asked_at > self._storage_timeout_s:
            return 0  # the store did not answer in time: a miss, agreed like any other
        return found

    def fetched(self, serial: int) -> int:
        progress = self._fetches.get(serial)
        return progress.prefix() if progress else 0

    def fetch_ended(self, serial: int) -> bool:
        """Every read has returned, or the store has had storage_timeout_s
        (reads still running keep their slots busy: see `idle`)."""
        progress = self._fetches.get(serial)
        if progress is None or progress.finished == len(progress.chunks):
            return True
        return self._clock() - progress.started > self._storage_timeout_s

    def read_failed(self, serial: int) -> bool:
        """A read of this fetch returned fewer pages than it asked for (a
        damaged page, a storage error): the pages after it never come."""
        progress = self._fetches.get(serial)
        if progress is None:
            return False
        return any(d is not None and d < size for size, d in zip(progress.chunks, progress.done))

    def elapsed_s(self, serial: int) -> float:
        progress = self._fetches.get(serial)
        return self._clock() - progress.started if progress else 0.0

    def write_outcome(self, serial: int) -> CopyOutcome:
        return self._writes.get(serial, CopyOutcome.PENDING)

    def backup_outcome(self, serial: int) -> BackupOutcome:
        outcome, started = self._backups.get(serial, (BackupOutcome.PENDING, self._clock()))
        if outcome == BackupOutcome.PENDING and self._clock() - started > self._storage_timeout_s:
            return BackupOutcome.TIMED_OUT
        return outcome

    def load_outcome(self, serial: int) -> CopyOutcome:
        return self._loads.get(serial, CopyOutcome.PENDING)

    def idle(self, slots: list[int]) -> bool:
        return not self.transfers.in_flight.busy(slots)

    # -- for the scheduler's local waits --------------------------------------------

    def load_future(self, op_id: int) -> Future | None:
        return self._load_jobs.get(op_id)

    def forget(self, closed_serials: list[int]) -> None:
        """Drop the progress of operations that have closed."""
        for serial in closed_serials:
            for table in (self._exists, self._fetches, self._writes, self._backups, self._loads):
                table.pop(serial, None)

    # -- for the rank's attach, epochs, match and stats: the movers stay behind this door --

    @property
    def storage(self) -> StorageBackend | None:
        return self.transfers.tiers.storage

    def run_storage_call(self, fn: Callable[[], T]) -> Future[T]:
        """A blocking storage call that is not a transfer, on the storage executor."""
        return self.transfers.run_storage_call(fn)

    def begin_session(self, epoch: int, number: int, device: DevicePool) -> None:
        """Issue every job in a new session from now on: each binds `device` when issued."""
        self.session = Session(epoch, number, device)

    def end_session(self) -> Session:
        """End the current session (its storage jobs not started yet are
        refused, its copies run to their end); -> it, to wait until none of
        its jobs touches the device pool."""
        self.session.end()
        return self.session

    def wait_idle(self, timeout_s: float) -> bool:
        """Until no host slot has I/O in flight (True), or `timeout_s` passes (False)."""
        return self.transfers.in_flight.wait_all_idle(timeout_s)

    def busy_slots(self) -> list[int]:
        """The host slots with I/O in flight now."""
        return self.transfers.in_flight.slots()

    def transfer_counters(self) -> dict[str, dict[tuple[str, str], int]]:
        return self.transfers.counters()

    def renewed(self, storage_timeout_s: float) -> LocalIO:
        """A fresh record of this rank's I/O over the same movers (a new epoch's)."""
        return LocalIO(self.transfers, storage_timeout_s, self._clock)

    def finish_copies(self, timeout_s: float) -> Finished:
        """At a graceful stop: no more jobs, and the copies issued end (`Transfers.finish_copies`)."""
        return self.transfers.finish_copies(timeout_s)

    def close(self) -> None:
        """Stop the movers and close the storage."""
        self.transfers.close()


def _ended_session() -> Session:
    session = Session(-1, 0, None)
    session.end()
    return session



def _result(job: Future) -> TransferResult:
    """A job's result; a job cancelled at shutdown is a failed transfer."""
    if job.cancelled() or job.exception() is not None:
        return TransferResult(0, False, 0)
    return job.result()
