"""The `file` backend: one file per page under a root every daemon sharing the pages shares.

Each file is a framed page (`framing`: header with magic, geometry
fingerprint, length and checksum, then the page bytes). Keys are checked so
that no key can name a path outside the root.

Durability: a page is written to a temp file and renamed into place, so a
key names a whole page or nothing, and its checksum is checked at every
read: a cache never reads a torn page. With `durable` (off by default: a
cache need not outlive a power cut, and a sync per page costs the write
path most of its speed) the page's data is synced before the rename and
its directory once per batch before the batch reports stored, so a backup
reported stored survives power loss.

Damage: a page that reads truncated, with trailing bytes, not framed or
with a bad checksum is a miss, deleted if it is still the file read (and
if the root lets it be); put-if-absent skips a write only when the stored
header promises exactly these bytes and the file has their length.

Temp files: named `.<key>.<host>-<pid>-<random>.tmp`. At start, those of a
dead writer on this host, and any older than `STALE_TMP_S`, are deleted and
counted (`storage_tmp_swept_files`, `storage_tmp_swept_bytes`).

Capacity is for the whole root, not per process: recency is each file's
mtime (set on write, bumped on every read hit), and each daemon rescans the
root after writing 1/`RESCAN_FRACTION` of the capacity, so it evicts the
least recently used pages of every daemon sharing the root, not only its
own. Between rescans a daemon does not see the others' writes, so the root
may exceed the capacity by up to 1/`RESCAN_FRACTION` of it per writer.
Eviction (and its rescans, a `stat` of every page in the root) runs on its
own thread after the put that asked for it (on the put's path it made
bounded puts 2.5 times as slow); a put that finds the root over the
capacity by more than 1/`RESCAN_FRACTION` waits for it. A
rescan keeps what this daemon wrote, read or deleted while it listed the
root. An eviction that fails is logged and counted (`storage_eviction_errors`),
and the next put tries again. `wait_evictions` waits for it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import NamedTuple, TypeVar

from cpcache.config import DaemonConfig
from cpcache.dataplane.storage import PageBuffer, StorageBackend, register
from cpcache.dataplane.storage.file_names import KEY_PATTERN, Clock, check_key, fsync_dir, host_tag, stale_tmp
from cpcache.dataplane.storage.framing import HEADER, Verdict, check_header, check_page, checksum, pack_header
from cpcache.geometry import KVGeometry

# Below this page size a read is mostly interpreter time, which threads only
# contend for; above it the syscalls and checksums (GIL released) overlap. A
# write is mostly the kernel's (a file created, then renamed) at any size.
PARALLEL_READ_MIN_PAGE_BYTES = 256 << 10
PARALLEL_WRITE_MIN_PAGE_BYTES = 0
RESCAN_FRACTION = 32

log = logging.getLogger(__name__)


T = TypeVar("T")


class Stored(NamedTuple):
    """A page a put left stored: its file's bytes and mtime, and whether this put wrote it."""

    size: int
    mtime_ns: int
    written: bool


@register("file")
class FileBackend(StorageBackend):
    @classmethod
    def from_settings(cls, config: DaemonConfig, geometry: KVGeometry,
                      buffers: list[tuple[int, int]]) -> FileBackend:
        return cls(root=config.storage_root, geometry_fingerprint=geometry.fingerprint(),
                   capacity_bytes=config.storage_capacity_bytes, io_threads=config.io_threads,
                   page_bytes=geometry.page_bytes, durable=config.storage_durable)

    def __init__(
        self, root: str, geometry_fingerprint: int, capacity_bytes: int = 0, io_threads: int = 4,
        page_bytes: int = 0, durable: bool = False,
    ) -> None:
        """`page_bytes` (0: unknown) lets a lookup tell a whole page from a
        truncated one by its size."""
        self.root = os.path.realpath(root)
        os.makedirs(self.root, exist_ok=True)
        self._geometry = geometry_fingerprint
        self._capacity = capacity_bytes  # 0: unlimited
        self._durable = durable
        self._page_file_bytes = HEADER.size + page_bytes if page_bytes else 0
        self._tag = f"{host_tag()}-{os.getpid()}"
        self._now_ns = Clock()
        self._lock = threading.Lock()  # the index and the counters
        # key -> (file bytes, mtime ns), least recently used first: the last
        # scan of the root, plus this process's touches since.
        self._index: collections.OrderedDict[str, tuple[int, int]] = collections.OrderedDict()
        self._bytes = 0
        self._written_since_scan = 0
        self._dirs: set[str] = set()  # fan-out directories known to exist
        self._counters = collections.Counter[str]()
        # Pages of one batch are read and written in parallel: the syscalls and
        # the checksum release the GIL, so they overlap.
        self._threads = io_threads
        self._workers = ThreadPoolExecutor(io_threads, thread_name_prefix="cpcache-file")
        self._evictor = ThreadPoolExecutor(1, thread_name_prefix="cpcache-evict")
        self._eviction: Future[None] | None = None  # the eviction queued or running, if any
        self._eviction_queued = False
        self._during_scan: dict[str, tuple[int, int] | None] | None = None  # touched while listing
        self._scan(sweep=True)

    def path(self, key: str) -> str:
        check_key(key)
        return self._path(key)

    def _path(self, key: str) -> str:
        """A checked key's file: under the fan-out directory of its first two characters."""
        return f"{self.root}/{key[:2]}/{key}"

    # -- the root as a whole ------------------------------------------------------

    def _scan(self, sweep: bool = False) -> None:
        """Rebuild the index from every page file under the root (any
        daemon's), oldest first; with `sweep`, delete dead writers' temp
        files and count them."""
        now = time.time()
        with self._lock:
            self._during_scan = {}  # what this daemon writes, reads and deletes while the root is listed
        try:
            found, swept_files, swept_bytes = self._listing(sweep, now)
        except BaseException:
            with self._lock:
                self._during_scan = None
            raise
        found.sort()
        with self._lock:
            index = collections.OrderedDict((key, (size, mtime)) for mtime, key, size in found)
            # Puts and reads went on beside the listing: what they did stands, as the most recent.
            for key, entry in self._during_scan.items():
                index.pop(key, None)
                if entry is not None:
                    index[key] = entry
            self._during_scan = None
            self._index = index
            self._bytes = sum(size for size, _ in index.values())
            self._written_since_scan = 0
            self._counters["storage_tmp_swept_files"] += swept_files
            self._counters["storage_tmp_swept_bytes"] += swept_bytes
            self._counters["storage_root_scans"] += 1

    def _listing(self, sweep: bool, now: float) -> tuple[list[tuple[int, str, int]], int, int]:
        """(mtime, key, size) of every page file under the root; with `sweep`,
        dead writers' temp files deleted, and their count and bytes."""
        found: list[tuple[int, str, int]] = []
        swept_files = swept_bytes = 0
        for entry in os.scandir(self.root):
            if not entry.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(FileNotFoundError):
                for page in os.scandir(entry.path):
                    try:
                        if not page.is_file(follow_symlinks=False):
                            continue
                        st = page.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # deleted meanwhile by another daemon
                    if not page.name.startswith("."):
                        if KEY_PATTERN.fullmatch(page.name):  # not a page's name: not ours to evict
                            found.append((st.st_mtime_ns, page.name, st.st_size))
                    elif sweep and stale_tmp(self._tag, page.name, now - st.st_mtime):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(page.path)
                            swept_files += 1
                            swept_bytes += st.st_size
        return found, swept_files, swept_bytes

    # -- StorageBackend -------------------------------------------------------------

    def exists_prefix(self, keys: list[str]) -> int:
        for i, key in enumerate(keys):
            try:
                size = os.stat(self.path(key)).st_size
            except FileNotFoundError:
                return i
            if self._page_file_bytes and size != self._page_file_bytes:
                return i  # truncated (or another geometry's page): not a page we can read
        return len(keys)

    def get_into(self, keys: list[str], pages: list[PageBuffer]) -> list[bool]:
        # Recency in the batch's order, as for a put.
        stamps = self._now_ns.stamps(len(keys))
        read = self._parallel(lambda i: self._read(keys[i], pages[i], stamps[i]), keys, pages,
                              PARALLEL_READ_MIN_PAGE_BYTES)
        self._touch_all([(key, size, stamp) for key, size, stamp in zip(keys, read, stamps) if size])
        return [bool(size) for size in read]

    def put_from(self, keys: list[str], pages: list[PageBuffer]) -> list[bool]:
        # Recency in the batch's order, whichever thread writes which page:
        # the files' mtimes, and this daemon's index (touched here, in order).
        stamps = self._now_ns.stamps(len(keys))
        stored = self._parallel(lambda i: self._write(keys[i], pages[i], stamps[i]), keys, pages,
                                PARALLEL_WRITE_MIN_PAGE_BYTES)
        self._touch_all([(key, page.size, page.mtime_ns) for key, page in zip(keys, stored) if page is not None])
        with self._lock:
            self._written_since_scan += sum(page.size for page in stored if page is not None and page.written)
        done = [page is not None for page in stored]
        # The renames of this batch survive a crash once their directories are synced.
        synced: dict[str, bool] = {}
        for i, key in enumerate(keys if self._durable else ()):
            if done[i]:
                directory = os.path.dirname(self.path(key))
                if directory not in synced:
                    synced[directory] = fsync_dir(directory)
                done[i] = synced[directory]
        self._evict_soon()
        return done

    def wait_evictions(self) -> None:
        """Wait until the eviction the puts so far asked for has run."""
        self._evictor.submit(lambda: None).result()

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {**self._counters, "storage_file_bytes": self._bytes}

    def _parallel(self, one: Callable[[int], T], keys: list[str], pages: list[PageBuffer],
                  min_page_bytes: int) -> list[T]:
        """`one(i)` for every page of the batch, in a few contiguous chunks,
        one per worker, for pages of `min_page_bytes` or more."""
        for key in keys:
            check_key(key)
        if len(pages) < 2 or pages[0].nbytes < min_page_bytes:
            return [one(i) for i in range(len(pages))]
        chunk = max(1, -(-len(keys) // self._threads))
        spans = [range(i, min(i + chunk, len(keys))) for i in range(0, len(keys), chunk)]
        done = self._workers.map(lambda span: [one(i) for i in span], spans)
        return [ok for part in done for ok in part]

    def close(self) -> None:
        self._workers.shutdown(wait=True)
        self._evictor.shutdown(wait=False, cancel_futures=True)  # a hung rescan does not hold the stop

    # -- one page -------------------------------------------------------------------

    def _read(self, key: str, page: PageBuffer, stamp: int) -> int:
        """Read one page and stamp it recent: the file's bytes, 0 for a miss."""
        path = self._path(key)  # the batch's keys are checked
        header = bytearray(HEADER.size)
        beyond = bytearray(1)  # a byte past the page: a file with trailing bytes is not one
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return 0  # missing, or a link or something else planted in the root: not a page
        try:
            try:
                got = os.readv(fd, [header, *page.views, beyond])
            except OSError:
                return 0
            if got != HEADER.size + page.nbytes:
                verdict = Verdict.DAMAGED  # truncated, or trailing bytes
            else:
                verdict = check_page(header, page.views, self._geometry, page.nbytes)
            if verdict is Verdict.DAMAGED:
                self._delete_damaged(key, path, fd)
                return 0
            if verdict is Verdict.FOREIGN:
                return 0  # another geometry's page: a miss, and the next backup replaces it
            try:
                os.utime(fd, ns=(stamp, stamp))  # recency, visible to every daemon sharing the root
            except OSError:
                pass
        finally:
            os.close(fd)
        return got

    def _delete_damaged(self, key: str, path: str, fd: int) -> None:
        """Delete the damaged file that was read (open as `fd`), not a whole
        page a writer renamed into its place meanwhile."""
        try:
            read, now = os.fstat(fd), os.lstat(path)
            if (now.st_dev, now.st_ino) != (read.st_dev, read.st_ino):
                return
            os.unlink(path)
        except OSError:
            return  # gone meanwhile, or not ours to delete (a read-only root): the read is a miss all the same
        self._forget(key)
        with self._lock:
            self._counters["storage_damaged_pages_deleted"] += 1

    def _already_stored(self, path: str, nbytes: int, digest: int) -> bool:
        """Put-if-absent: a stored page counts only if its header promises
        exactly these bytes and the file has their length."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            header = os.read(fd, HEADER.size)
            size = os.fstat(fd).st_size
        except OSError:
            return False
        finally:
            os.close(fd)
        verdict, stored_digest = check_header(header, self._geometry, nbytes)
        return verdict is Verdict.VALID and stored_digest == digest and size == HEADER.size + nbytes

    def _write(self, key: str, page: PageBuffer, stamp: int) -> Stored | None:
        """Store one page, its mtime `stamp`; None if it could not be."""
        path = self._path(key)  # the batch's keys are checked
        digest = checksum(page.views)
        size = HEADER.size + page.nbytes
        if self._already_stored(path, page.nbytes, digest):
            # Keys name their content (a hash chain): a whole page already
            # stored under its key holds these bytes. It is recent now (a
            # stamp of now: the batch's may be older than a read of it since).
            now = self._now_ns()
            try:
                os.utime(path, ns=(now, now), follow_symlinks=False)
                return Stored(size, now, written=False)
            except FileNotFoundError:
                pass  # evicted since it was checked: write it again
            except OSError:
                return Stored(size, now, written=False)
        header = pack_header(self._geometry, page.views, digest)
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f".{key}.{self._tag}-{uuid.uuid4().hex[:8]}.tmp")
        try:
            if directory not in self._dirs:
                os.makedirs(directory, exist_ok=True)
                self._dirs.add(directory)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                written = os.writev(fd, [header, *page.views])
                if written != size:
                    raise OSError(f"short write of {key}")
                if self._durable:
                    os.fdatasync(fd)  # the data is on disk before any name points at it
                os.utime(fd, ns=(stamp, stamp))
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return None  # a full disk or a vanished root: a failed put, reported as data
        return Stored(size, stamp, written=True)

    # -- recency and capacity -------------------------------------------------------

    def _touch(self, key: str, size: int, mtime_ns: int) -> None:
        self._touch_all([(key, size, mtime_ns)])

    def _touch_all(self, touched: list[tuple[str, int, int]]) -> None:
        """Move pages (key, file bytes, mtime ns) to the recent end of the index, in order."""
        with self._lock:
            for key, size, mtime_ns in touched:
                if self._during_scan is not None:
                    self._during_scan[key] = (size, mtime_ns)
                old = self._index.pop(key, None)
                self._bytes += size - (old[0] if old else 0)
                self._index[key] = (size, mtime_ns)

    def _forget(self, key: str) -> None:
        with self._lock:
            if self._during_scan is not None:
                self._during_scan[key] = None
            old = self._index.pop(key, None)
            if old:
                self._bytes -= old[0]

    def _evict_soon(self) -> None:
        """Queue an eviction on the evictor's thread, unless one is queued
        already; wait for it when the root is past the capacity by more than
        1/RESCAN_FRACTION (the puts outrun it)."""
        if not self._capacity:
            return
        with self._lock:
            behind = self._bytes > self._capacity + self._capacity // RESCAN_FRACTION
            eviction = self._eviction
            if not self._eviction_queued:
                self._eviction_queued = True
                try:
                    eviction = self._eviction = self._evictor.submit(self._evict_queued)
                except RuntimeError:  # closed: nothing more to evict for
                    self._eviction_queued = False
                    return
        if behind and eviction is not None:
            with contextlib.suppress(CancelledError):  # closed meanwhile
                eviction.result()

    def _evict_queued(self) -> None:
        with self._lock:
            self._eviction_queued = False
        try:
            self._maybe_evict()
        except Exception:  # noqa: BLE001 - a thread's failure is logged, counted and retried by the next put
            log.exception("file storage: eviction failed; the next put tries again")
            with self._lock:
                self._counters["storage_eviction_errors"] += 1

    def _maybe_evict(self) -> None:
        with self._lock:
            rescan = self._written_since_scan * RESCAN_FRACTION > self._capacity
        try:
            if rescan:
                self._scan()  # learn the other daemons' writes and reads
        finally:
            self._evict()  # with what this index knows, if the rescan failed

    def _evict(self) -> None:
        """Delete least recently used pages until the root fits. A page some
        daemon touched since this index saw it is kept and moved up."""
        while True:
            with self._lock:
                if self._bytes <= self._capacity or len(self._index) <= 1:
                    return
                key, (size, mtime_ns) = self._index.popitem(last=False)
                self._bytes -= size
            path = self.path(key)
            try:
                now = os.lstat(path)
            except OSError:
                continue  # another daemon evicted it (or it cannot be seen: not counted)
            if now.st_mtime_ns > mtime_ns:
                self._touch(key, now.st_size, now.st_mtime_ns)  # read or rewritten meanwhile: recent
                continue
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # another daemon evicted it meanwhile
            except OSError:
                continue  # not ours to delete after all (a read-only root): its bytes stay uncounted
            with self._lock:
                self._counters["storage_pages_evicted"] += 1

    @property
    def used_bytes(self) -> int:
        return self._bytes

