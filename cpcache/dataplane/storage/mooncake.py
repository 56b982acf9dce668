"""The `mooncake` backend: Mooncake Store over its transfer engine.

The host pool is registered with the transfer engine once, so batch puts and
gets move bytes straight between host pages and the store. Each object is a
framed page like a stored file (`framing`: header with magic, geometry
fingerprint, length, checksum, then the page): the header travels from a
small registered arena in the same multi-buffer call, and a read checks it
all, so a foreign, truncated or corrupt object loads as a miss, never as
KV; a damaged one is removed so the next backup rewrites it.
"""

from __future__ import annotations

import collections
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from cpcache.config import DaemonConfig
from cpcache.dataplane.storage import PageBuffer, StorageBackend, register
from cpcache.dataplane.storage.framing import HEADER, check_batch, digests, in_spans, pack_header_into
from cpcache.errors import InvalidArgument, Unavailable
from cpcache.geometry import KVGeometry
from cpcache.values import split_host_port

CHECK_THREADS = min(4, os.cpu_count() or 1)  # a batch's pages are checksummed on this many threads at once ...
PARALLEL_CHECK_MIN_PAGE_BYTES = 256 << 10  # ... from this page size (below, the per-page Python costs more)
HEADERS_PER_LEASE = 1024  # headers one call frames at once (each call has its cost); larger batches go in parts
LEASES = 16  # calls that may frame at once


class HeaderArena:
    """Registered memory for page headers, leased to one call at a time."""

    def __init__(self) -> None:
        self.buffer = np.zeros(LEASES * HEADERS_PER_LEASE * HEADER.size, dtype=np.uint8)
        self.view = self.buffer.data  # for struct's pack_into and one copy out per call
        self._free = list(range(LEASES))
        self._ready = threading.Condition()

    @property
    def address(self) -> int:
        return int(self.buffer.ctypes.data)

    def lease(self) -> int:
        with self._ready:
            self._ready.wait_for(lambda: bool(self._free))
            return self._free.pop()

    def give_back(self, lease: int) -> None:
        with self._ready:
            self._free.append(lease)
            self._ready.notify()

    def offset(self, lease: int) -> int:
        """Where a lease's first header starts in `buffer` (its headers follow one another)."""
        return lease * HEADERS_PER_LEASE * HEADER.size


def _reachable(address: str, timeout_s: float) -> bool:
    try:
        socket.create_connection(split_host_port(address, "storage_master"), timeout_s).close()
        return True
    except (OSError, InvalidArgument):
        return False


OBJECT_ALREADY_EXISTS = -705  # Mooncake's ErrorCode for a put of a key the store holds
NO_AVAILABLE_HANDLE = -200  # its ErrorCode for a put the segments have no room for (yet)
# A full store evicts a few percent of its objects per pass of the master's
# eviction thread, on the puts it refused: the refused pages are put again
# after these waits (seconds, for one put_from in all, whatever its parts),
# then given up (a failed put, as any). A store still full after them gets
# no waits for FULL_BACKOFF_S: the storage threads that serve lookups and
# reads too do not all sleep on it.
SPACE_RETRY_WAITS_S = (0.01, 0.02, 0.05, 0.1, 0.2)
FULL_BACKOFF_S = 1.0
COUNTERS = ("storage_damaged_pages_deleted", "storage_put_space_retries", "storage_puts_refused_for_space")

def engine_environment(local_hostname: str) -> dict[str, str]:
    """What Mooncake's transfer engine reads from the environment, from the
    settings: for the daemon's entry point to set before the engine starts
    (the library itself never touches the environment). Without
    MC_TCP_BIND_ADDRESS the engine advertises its RPC at the first non-loopback
    interface's address ("Found active interface eth0"), and its peers reach
    it there, whatever `storage_local_hostname` says."""
    return {"MC_TCP_BIND_ADDRESS": local_hostname}


@register("mooncake")
class MooncakeBackend(StorageBackend):
    @classmethod
    def from_settings(cls, config: DaemonConfig, geometry: KVGeometry,
                      buffers: list[tuple[int, int]]) -> MooncakeBackend:
        return cls(master=config.storage_master, metadata_server=config.storage_metadata_server, buffers=buffers,
                   protocol=config.storage_protocol, local_hostname=config.storage_local_hostname,
                   device_name=config.storage_device, global_segment_size=config.storage_segment_bytes,
                   geometry_fingerprint=geometry.fingerprint())

    def __init__(
        self,
        master: str,
        metadata_server: str,
        buffers: list[tuple[int, int]],
        protocol: str = "tcp",
        local_hostname: str = "127.0.0.1",
        device_name: str = "",
        global_segment_size: int = 256 << 20,
        local_buffer_size: int = 64 << 20,
        connect_timeout_s: float = 5.0,
        geometry_fingerprint: int = 0,
        space_retry_waits_s: Sequence[float] = SPACE_RETRY_WAITS_S,
    ) -> None:
        """`buffers`: (address, nbytes) of host memory to register (the host
        pool); `space_retry_waits_s`: the waits before each new put of the
        pages a full store refused."""
        self._geometry = geometry_fingerprint
        self._space_retry_waits_s = tuple(space_retry_waits_s)
        self._closed = True
        from mooncake.store import MooncakeDistributedStore

        if not _reachable(master, connect_timeout_s):
            raise Unavailable(
                f"mooncake: the master at {master} cannot be reached; start mooncake_master "
                f"or fix the setting storage_master"
            )
        self._store = MooncakeDistributedStore()
        try:
            rc = self._store.setup(
                local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol, device_name, master
            )
            if rc != 0:
                raise Unavailable(f"mooncake: setup against master {master} failed with code {rc}")
            self._headers = HeaderArena()
            for address, nbytes in [*buffers, (self._headers.address, self._headers.buffer.nbytes)]:
                if self._store.register_buffer(address, nbytes) != 0:
                    raise InvalidArgument(f"mooncake: cannot register {nbytes} bytes at {address:#x}")
        except BaseException:
            self._store.close()  # a client that failed to set up holds its ports and threads until closed
            raise
        self._closed = False
        self._closing = threading.Event()  # cuts a put's wait for room short
        self._full_until = 0.0  # monotonic time until which a refused put is not tried again
        self._counts = collections.Counter[str]()  # the storage threads count, the metrics thread reads
        self._counts_lock = threading.Lock()
        self._checkers = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="cpcache-check")

    def exists_prefix(self, keys: list[str]) -> int:
        if not keys:
            return 0
        for i, present in enumerate(self._store.batch_is_exist(keys)):
            if present != 1:
                return i
        return len(keys)

    def get_into(self, keys: list[str], pages: list[PageBuffer]) -> list[bool]:
        return self._in_parts(self._get_part, keys, pages)

    def put_from(self, keys: list[str], pages: list[PageBuffer]) -> list[bool]:
        waits = iter(self._space_retry_waits_s if time.monotonic() >= self._full_until else ())
        return self._in_parts(lambda lease, k, p: self._put_part(lease, k, p, waits), keys, pages)

    def counters(self) -> dict[str, int]:
        with self._counts_lock:
            return {name: self._counts[name] for name in COUNTERS}

    def _count(self, name: str, n: int) -> None:
        if n:
            with self._counts_lock:
                self._counts[name] += n

    def _in_parts(self, part: Callable[[int, list[str], list[PageBuffer]], list[bool]], keys: list[str],
                  pages: list[PageBuffer]) -> list[bool]:
        done: list[bool] = []
        if not keys:
            return done
        lease = self._headers.lease()
        try:
            for first in range(0, len(keys), HEADERS_PER_LEASE):
                span = slice(first, first + HEADERS_PER_LEASE)
                done += part(lease, keys[span], pages[span])
        finally:
            self._headers.give_back(lease)
        return done

    def _put_part(self, lease: int, keys: list[str], pages: list[PageBuffer], waits: Iterator[float]) -> list[bool]:
        """Put one part of a batch; `waits`: what is left of the batch's waits for room."""
        first = self._headers.offset(lease)
        address = self._headers.address + first
        pointers, sizes = self._layout(address, pages)
        for i, (page, digest) in enumerate(zip(pages, self._checksums(pages))):
            pack_header_into(self._headers.view, first + i * HEADER.size, self._geometry, page.views, digest)
        codes = self._store.batch_put_from_multi_buffers(keys, pointers, sizes)
        refused = [i for i, code in enumerate(codes) if code == NO_AVAILABLE_HANDLE]
        while refused:
            wait = next(waits, None)
            if wait is None or self._closing.wait(wait):
                break
            self._count("storage_put_space_retries", 1)
            again = self._store.batch_put_from_multi_buffers([keys[i] for i in refused], [pointers[i] for i in refused],
                                                             [sizes[i] for i in refused])
            for i, code in zip(refused, again):
                codes[i] = code
            refused = [i for i in refused if codes[i] == NO_AVAILABLE_HANDLE]
        if refused:
            self._full_until = time.monotonic() + FULL_BACKOFF_S
            self._count("storage_puts_refused_for_space", len(refused))
        # A page someone stored first (another replica's writer, a retry) is
        # stored: keys name their bytes, and a damaged object is deleted by
        # the read that finds it, so the next put rewrites it.
        return [code in (0, OBJECT_ALREADY_EXISTS) for code in codes]

    def _checksums(self, pages: list[PageBuffer]) -> list[int]:
        """Each page's XXH3, large pages hashed on the checking threads at once."""
        runs = [page.views for page in pages]
        return in_spans(lambda span: digests(runs, span), list(range(len(pages))), self._checkers_for(pages),
                        CHECK_THREADS)

    @staticmethod
    def _layout(address: int, pages: list[PageBuffer]) -> tuple[list[list[int]], list[list[int]]]:
        """A multi-buffer call's pointers and sizes: each page's header (in
        the arena from `address` on), then its runs."""
        header = HEADER.size
        return ([[address + i * header, *page.addresses] for i, page in enumerate(pages)],
                [[header, *page.sizes] for page in pages])

    def _checkers_for(self, pages: list[PageBuffer]) -> ThreadPoolExecutor | None:
        """The checking threads for a batch of large pages; None: hash in turn."""
        return self._checkers if pages and pages[0].nbytes >= PARALLEL_CHECK_MIN_PAGE_BYTES else None

    def _get_part(self, lease: int, keys: list[str], pages: list[PageBuffer]) -> list[bool]:
        first = self._headers.offset(lease)
        pointers, sizes = self._layout(self._headers.address + first, pages)
        got = self._store.batch_get_into_multi_buffers(keys, pointers, sizes)
        if len(got) != len(keys):
            return [False] * len(keys)  # not an answer per key: nothing of it is read
        # The whole batch checked at once (framing.check_batch): its header
        # fields and checksums compared as arrays, each page costing its hash.
        lengths = np.fromiter((page.nbytes for page in pages), dtype=np.uint64, count=len(pages))
        read = np.asarray(got, dtype=np.int64)
        valid, damaged = check_batch(self._headers.view[first : first + len(pages) * HEADER.size],
                                     [page.views for page in pages], lengths,
                                     read == lengths.astype(np.int64) + HEADER.size, self._geometry,
                                     self._checkers_for(pages), CHECK_THREADS)
        # A damaged object is removed (force: past the read lease) so the
        # next backup rewrites it; a missing one (or of another size) is a miss.
        for i in np.flatnonzero(damaged & (read >= 0)).tolist():
            self._count("storage_damaged_pages_deleted", int(self._store.remove(keys[i], True) == 0))
        return valid.tolist()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._closing.set()
            self._checkers.shutdown(wait=False)  # a call still running hashes its own runs (in_spans)
            self._store.close()
