"""The `file` backend: one file per page under a root directory.

Each file is a 40-byte header (magic, version, geometry fingerprint, payload
length, XXH3-64 checksum of the payload) followed by the page bytes. Writes
go to a temp file that is renamed into place, so a reader sees a whole page
or none. A corrupt, truncated or foreign-geometry page reads as a miss. Keys
are checked so that no key can name a path outside the root. A capacity
limit evicts the least recently used pages this process knows of.
"""

from __future__ import annotations

import collections
import os
import re
import struct
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import xxhash

from cpcache.dataplane.storage import PageBuffer, StorageBackend, register
from cpcache.errors import InvalidArgument

MAGIC = b"CPCPAGE1"
HEADER = struct.Struct("<8sIIQQQ")  # magic, version, reserved, geometry, length, checksum
VERSION = 1
# Below this page size a read is mostly interpreter time, which threads only
# contend for; above it the syscalls and checksums (GIL released) overlap.
PARALLEL_MIN_PAGE_BYTES = 256 << 10
KEY_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,254}")


def check_key(key: str) -> str:
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key) or ".." in key:
        raise InvalidArgument(f"storage: key {key!r} is not a plain name ([A-Za-z0-9_.-], no '..')")
    return key


@register("file")
class FileBackend(StorageBackend):
    def __init__(
        self, root: str, geometry_fingerprint: int, capacity_bytes: int = 0, io_threads: int = 4,
        **_ignored: object,
    ) -> None:
        self.root = os.path.realpath(root)
        os.makedirs(self.root, exist_ok=True)
        self._geometry = geometry_fingerprint
        self._capacity = capacity_bytes  # 0: unlimited
        self._lock = threading.Lock()
        self._lru: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._dirs: set[str] = set()  # fan-out directories known to exist
        # Pages of one batch are read and written in parallel: the syscalls and
        # the checksum release the GIL, so they overlap.
        self._threads = io_threads
        self._workers = ThreadPoolExecutor(io_threads, thread_name_prefix="cpcache-file")
        self._bytes = 0
        self._load_index()

    def path(self, key: str) -> str:
        check_key(key)
        return os.path.join(self.root, key[:2], key)

    def _load_index(self) -> None:
        found = []
        for entry in os.scandir(self.root):
            if entry.is_dir(follow_symlinks=False):
                for page in os.scandir(entry.path):
                    if page.is_file(follow_symlinks=False) and not page.name.startswith("."):
                        st = page.stat()
                        found.append((st.st_mtime, page.name, st.st_size))
        for _, key, size in sorted(found):
            self._lru[key] = size
            self._bytes += size

    def exists_prefix(self, keys: list[str]) -> int:
        for i, key in enumerate(keys):
            if not os.path.exists(self.path(key)):
                return i
        return len(keys)

    def get_into(self, keys: list[str], pages: list[PageBuffer]) -> list[bool]:
        return self._parallel(self._read, keys, pages)

    def put_from(self, keys: list[str], pages: list[PageBuffer]) -> list[bool]:
        return self._parallel(self._write, keys, pages)

    def _parallel(self, one: Callable[[str, PageBuffer], bool], keys: list[str], pages: list[PageBuffer]) -> list[bool]:
        """Run `one` over the batch in a few contiguous chunks, one per worker."""
        for key in keys:
            check_key(key)
        if not pages or pages[0].nbytes < PARALLEL_MIN_PAGE_BYTES:
            return [one(key, page) for key, page in zip(keys, pages)]
        chunk = max(1, -(-len(keys) // self._threads))
        spans = [range(i, min(i + chunk, len(keys))) for i in range(0, len(keys), chunk)]
        done = self._workers.map(lambda span: [one(keys[i], pages[i]) for i in span], spans)
        return [ok for part in done for ok in part]

    def close(self) -> None:
        self._workers.shutdown(wait=True)

    def _read(self, key: str, page: PageBuffer) -> bool:
        header = bytearray(HEADER.size)
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            got = os.readv(fd, [header, page.view.data])
        except OSError:
            return False
        finally:
            os.close(fd)
        if got != HEADER.size + page.nbytes:
            return False  # truncated
        magic, version, _, geometry, length, checksum = HEADER.unpack(header)
        if magic != MAGIC or version != VERSION or geometry != self._geometry or length != page.nbytes:
            return False  # not ours, or another geometry
        if xxhash.xxh3_64_intdigest(page.view.data) != checksum:
            return False  # corrupt
        self._touch(key, got)
        return True

    def _write(self, key: str, page: PageBuffer) -> bool:
        path = self.path(key)
        if key in self._lru and os.path.exists(path):
            # Keys name their content (a hash chain), so a page already stored
            # under its key holds these bytes: nothing to write.
            self._touch(key, HEADER.size + page.nbytes)
            return True
        header = HEADER.pack(MAGIC, VERSION, 0, self._geometry, page.nbytes, xxhash.xxh3_64_intdigest(page.view.data))
        tmp = os.path.join(os.path.dirname(path), f".{key}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            directory = os.path.dirname(path)
            if directory not in self._dirs:
                os.makedirs(directory, exist_ok=True)
                self._dirs.add(directory)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                written = os.writev(fd, [header, page.view.data])
            finally:
                os.close(fd)
            if written != HEADER.size + page.nbytes:
                raise OSError(f"short write of {key}")
            os.replace(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False  # a full disk or a vanished root: a failed put, reported as data
        self._touch(key, HEADER.size + page.nbytes)
        self._evict()
        return True

    def _touch(self, key: str, size: int) -> None:
        with self._lock:
            old = self._lru.pop(key, None)
            self._bytes += size - (old or 0)
            self._lru[key] = size

    def _evict(self) -> None:
        if not self._capacity:
            return
        while True:
            with self._lock:
                if self._bytes <= self._capacity or len(self._lru) <= 1:
                    return
                key, size = self._lru.popitem(last=False)
                self._bytes -= size
            try:
                os.unlink(self.path(key))
            except FileNotFoundError:
                pass

    @property
    def used_bytes(self) -> int:
        return self._bytes
