"""The prefill server's flush generation, published in the store where a
decode server's offload reads it.

A prefill server over cpcache names its pages anew at each flush
(`keys.generation_pages`: a weight update's flush among them). A decode
server's offload is handed SGLang's page hashes only: it names its pages as
the prefill server reads them only if it knows how many flushes that server
has been through. So the prefill server's rank 0 publishes the number in
the store both share, and the decode server reads it before each call:

- The n-th record is one page under `flush_record(n)`, of the tenant (no
  shard suffix: every rank of either server finds the same one), holding
  the generation in its first 8 bytes (little endian). Records are numbered
  from 1 and each is written once, as a store's objects are.
- The prefill server publishes generation 0 at start (a restarted server
  starts over) and one record at each flush, from a thread of its own
  (`Publisher`): a slow store delays a record, never a scheduler step.
- The decode server looks up the records past the newest it knows
  (`RECORD_WINDOW` keys in one lookup) and reads the newest one's
  generation when there is a new one.

A decode server that has not seen a record yet (it is being written, or a
full store evicted it) names pages by an older generation: misses for the
prefill server, never pages of another generation.

No SGLang import here.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import torch

from cpcache.dataplane.storage import PageBuffer, StorageBackend
from cpcache.errors import CacheError
from cpcache.keys import ShardingSpec, flush_record

log = logging.getLogger(__name__)
RECORD_WINDOW = 8  # records looked up at once past the newest known


class RecordPage:
    """One page of host memory to register with a store: a record moves through it."""

    def __init__(self, page_bytes: int) -> None:
        self.memory = torch.zeros(page_bytes, dtype=torch.uint8)
        self.bytes = self.memory.numpy()
        self.buffer = PageBuffer(self.memory.data_ptr(), self.bytes)

    @property
    def region(self) -> tuple[int, int]:
        return self.memory.data_ptr(), self.bytes.nbytes


class FlushRecords:
    """The records of one tenant in one store, through `page` (registered with `backend`)."""

    def __init__(self, backend: StorageBackend, tenant: str, page: RecordPage) -> None:
        self.backend = backend
        self._names = ShardingSpec(tp_sharded_heads=False, tenant=tenant)  # no shard suffix
        self._page = page
        self._lock = threading.Lock()  # one record moves through the page at a time
        self._newest = 0  # the newest record number known
        self.generation = 0  # the newest record's generation

    def _key(self, number: int) -> str:
        return self._names.storage_key(flush_record(number))

    def _newest_stored(self) -> int:
        """The newest record number in the store, from the newest known on."""
        newest = self._newest
        while True:
            found = self.backend.exists_prefix([self._key(newest + 1 + i) for i in range(RECORD_WINDOW)])
            newest += found
            if found < RECORD_WINDOW:
                return newest

    def latest(self) -> int:
        """The generation of the newest record (0 while there is none)."""
        with self._lock:
            newest = self._newest_stored()
            if newest != self._newest and self.backend.get_into([self._key(newest)], [self._page.buffer])[0]:
                self._newest = newest
                self.generation = int.from_bytes(self._page.bytes[:8].tobytes(), "little")
            return self.generation

    def publish(self, generation: int) -> int:
        """Write the next record, of `generation`: -> its number (0: not written)."""
        with self._lock:
            number = self._newest_stored() + 1
            self._page.bytes[:] = 0
            self._page.bytes[:8] = list(generation.to_bytes(8, "little"))
            if not self.backend.put_from([self._key(number)], [self._page.buffer])[0]:
                return 0
            self._newest, self.generation = number, generation
            return number

    def close(self) -> None:
        self.backend.close()


class Publisher:
    """A prefill server's records, written in order on a thread of their own;
    the store is opened there at the first (`open_records`)."""

    def __init__(self, open_records: Callable[[], FlushRecords]) -> None:
        self._open_records = open_records
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self.published: list[int] = []  # the generations written, in order
        self._thread = threading.Thread(target=self._run, name="cpcache-flush-records", daemon=True)
        self._thread.start()

    def publish(self, generation: int) -> None:
        self._queue.put(generation)

    def wait_published(self, count: int, timeout_s: float) -> bool:
        """Wait until `count` records are written: -> whether they are."""
        with self._done:
            return self._done.wait_for(lambda: len(self.published) >= count, timeout_s)

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        records: FlushRecords | None = None
        while (generation := self._queue.get()) is not None:
            try:
                records = records or self._open_records()
                number = records.publish(generation)
            except (CacheError, OSError) as exc:  # the store is away: a decode server's pages miss for a while
                log.warning("cpcache: flush generation %d not published in the store: %s", generation, exc)
                continue
            if not number:
                log.warning("cpcache: flush generation %d not published: the store refused its record", generation)
                continue
            log.info("cpcache: published flush generation %d (record %d) for the decode servers' offload",
                     generation, number)
            with self._done:
                self.published.append(generation)
                self._done.notify_all()
        if records is not None:
            records.close()
