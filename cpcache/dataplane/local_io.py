"""This rank's side of the cache: runs the movers the shared state asks for,
and keeps their progress as the local answers of the next rounds. Progress
is written by I/O threads and read by the event loop; each record is a plain
value replaced whole, so no reader sees half an update."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from cpcache.state.machine import NOT_YET, TIMED_OUT, Intent
from cpcache.dataplane.movers import DEVICE, HOST, STORAGE, TransferResult, Transfers

FETCH_CHUNK_PAGES = 16  # a fetch reports progress chunk by chunk


@dataclass
class FetchProgress:
    started: float
    chunks: list[int]  # pages per chunk, in order
    done: list[int] = field(default_factory=list)  # pages done per finished chunk, by index
    finished: int = 0

    def prefix(self) -> int:
        total = 0
        for i, size in enumerate(self.chunks):
            if i >= len(self.done) or self.done[i] is None:
                return total
            total += self.done[i]
            if self.done[i] < size:
                return total
        return total


class LocalIO:
    def __init__(self, transfers: Transfers, storage_timeout_s: float = 10.0, clock=time.monotonic) -> None:
        """`storage_timeout_s`: a storage lookup that has not answered by then
        counts as a miss here, so a hung store never holds a prefetch open."""
        self.transfers = transfers
        self._clock = clock
        self._storage_timeout_s = storage_timeout_s
        self._exists: dict[int, int] = {}
        self._asked_at: dict[int, float] = {}
        self._fetches: dict[int, FetchProgress] = {}
        self._writes: dict[int, bool] = {}
        self._backups: dict[int, tuple[bool, int]] = {}
        self._backup_started: dict[int, float] = {}
        self._loads: dict[int, Future] = {}

    @property
    def has_storage(self) -> bool:
        return self.transfers.tiers.storage is not None

    # -- starting I/O ------------------------------------------------------------

    def start(self, intents: list[Intent]) -> None:
        for intent in intents:
            getattr(self, "_start_" + intent.action)(intent)

    def _start_exists(self, intent: Intent) -> None:
        self._exists[intent.op_id] = NOT_YET
        self._asked_at[intent.op_id] = self._clock()
        if not self.has_storage:
            self._exists[intent.op_id] = 0
            return

        def ask() -> None:
            try:
                self._exists[intent.op_id] = self.transfers.tiers.storage.exists_prefix(list(intent.keys))
            except Exception:  # storage down: an agreed miss, not a dead thread
                self._exists[intent.op_id] = 0

        self.transfers.run_blocking(ask)

    def _start_fetch(self, intent: Intent) -> None:
        n = len(intent.keys)
        sizes = [min(FETCH_CHUNK_PAGES, n - i) for i in range(0, n, FETCH_CHUNK_PAGES)]
        progress = FetchProgress(self._clock(), sizes, [None] * len(sizes))
        self._fetches[intent.op_id] = progress
        for index, first in enumerate(range(0, n, FETCH_CHUNK_PAGES)):
            span = slice(first, first + FETCH_CHUNK_PAGES)
            job = self.transfers.submit((STORAGE, HOST), intent.keys[span], intent.slots[span])
            job.add_done_callback(lambda f, i=index: self._fetched(progress, i, f.result()))

    @staticmethod
    def _fetched(progress: FetchProgress, index: int, result: TransferResult) -> None:
        progress.done[index] = result.pages_done
        progress.finished += 1

    def _start_write(self, intent: Intent) -> None:
        self._writes[intent.op_id] = False
        job = self.transfers.submit((DEVICE, HOST), intent.device_pages, intent.slots)
        job.add_done_callback(lambda f: self._writes.__setitem__(intent.op_id, True))

    def _start_backup(self, intent: Intent) -> None:
        if not intent.keys or not self.has_storage:
            # Not this rank's pages to write (or nowhere to write them): done
            # here, and still part of the agreed answer.
            self._backups[intent.op_id] = (True, int(not self.has_storage and bool(intent.keys)))
            return
        self._backups[intent.op_id] = (False, 0)
        self._backup_started[intent.op_id] = self._clock()
        job = self.transfers.submit((HOST, STORAGE), intent.slots, intent.keys)
        job.add_done_callback(lambda f: self._backups.__setitem__(intent.op_id, (True, int(not f.result().success))))

    def _start_load(self, intent: Intent) -> None:
        self._loads[intent.op_id] = self.transfers.submit((HOST, DEVICE), intent.slots, intent.device_pages)

    # -- LocalProgress ------------------------------------------------------------

    def exists(self, op_id: int) -> int:
        found = self._exists.get(op_id, NOT_YET)
        if found == NOT_YET and self._clock() - self._asked_at.get(op_id, self._clock()) > self._storage_timeout_s:
            return 0  # the store did not answer in time: a miss, agreed like any other
        return found

    def fetched(self, op_id: int) -> int:
        progress = self._fetches.get(op_id)
        return progress.prefix() if progress else 0

    def fetch_ended(self, op_id: int) -> bool:
        """Every read has returned, or the store has had storage_timeout_s
        (reads still running keep their slots busy: see `idle`)."""
        progress = self._fetches.get(op_id)
        if progress is None or progress.finished == len(progress.chunks):
            return True
        return self._clock() - progress.started > self._storage_timeout_s

    def elapsed_s(self, op_id: int) -> float:
        progress = self._fetches.get(op_id)
        return self._clock() - progress.started if progress else 0.0

    def write_done(self, op_id: int) -> bool:
        return self._writes.get(op_id, False)

    def backup_state(self, op_id: int) -> tuple[bool, int]:
        """(ended, outcome): outcome 0 stored, 1 failed, TIMED_OUT when the
        store has not answered in storage_timeout_s (the write may still be
        reading its host pages)."""
        ended, outcome = self._backups.get(op_id, (False, 0))
        started = self._backup_started.get(op_id)
        if not ended and started is not None and self._clock() - started > self._storage_timeout_s:
            return True, TIMED_OUT
        return ended, outcome

    def load_done(self, op_id: int) -> bool:
        job = self._loads.get(op_id)
        return job is not None and job.done()

    def idle(self, slots) -> bool:
        return not self.transfers.in_flight.busy(slots)

    # -- for the scheduler's local waits --------------------------------------------

    def load_future(self, op_id: int) -> Future | None:
        return self._loads.get(op_id)

    def forget(self, decisions) -> None:
        """Drop the progress of operations that the decisions closed."""
        for op_id, _ in decisions.prefetch_done + decisions.prefetch_revoked:
            self._exists.pop(op_id, None)
            self._asked_at.pop(op_id, None)
            self._fetches.pop(op_id, None)
        for op_id in decisions.write_acks:
            self._writes.pop(op_id, None)
        for op_id, _ in decisions.backups:
            self._backups.pop(op_id, None)
            self._backup_started.pop(op_id, None)
        for op_id, _ in decisions.loads:
            self._loads.pop(op_id, None)
