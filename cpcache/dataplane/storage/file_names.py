"""The file backend's names and small file-system helpers: page keys, the
temp files of writers (whose host and pid say whether the writer may still
be alive), the clock that orders pages by mtime, a directory's fsync."""

from __future__ import annotations

import os
import re
import socket
import threading
import time

import xxhash

from cpcache.errors import InvalidArgument

KEY_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,254}")
TMP_PATTERN = re.compile(r"\.(?P<key>.+)\.(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}\.tmp")
STALE_TMP_S = 600.0  # a temp file this old is a dead writer's, whichever host wrote it


def check_key(key: str) -> str:
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key) or ".." in key:
        raise InvalidArgument(f"storage: key {key!r} is not a plain name ([A-Za-z0-9_.-], no '..')")
    return key


def host_tag() -> str:
    return xxhash.xxh3_64_hexdigest(socket.gethostname().encode())[:8]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


class Clock:
    """Wall-clock nanoseconds, strictly increasing within this process, so
    pages touched one after another never tie in mtime order."""

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()

    def __call__(self) -> int:
        return self.stamps(1)[0]

    def stamps(self, n: int) -> range:
        """`n` stamps in a row, for a batch's pages in order (one lock, not n)."""
        with self._lock:
            first = max(time.time_ns(), self._last + 1)
            self._last = first + n - 1
            return range(first, first + n)


def stale_tmp(tag: str, name: str, age_s: float) -> bool:
    """Whether `name` is a temp file of a writer that is gone (`tag`: this
    process's `host-pid`)."""
    # The name first: a dot-file this daemon did not name (a
    # `.gitattributes` beside the pages) is never ours to delete, however old.
    match = TMP_PATTERN.fullmatch(name)
    if match is None:
        return False
    if age_s > STALE_TMP_S:
        return True
    if match["host"] != tag.split("-")[0]:
        return False  # another host's writer: only by age
    pid = int(match["pid"])
    return pid == os.getpid() or not pid_alive(pid)  # this process has no writes yet


def fsync_dir(directory: str) -> bool:
    """Sync a directory (the renames into it survive a crash): whether it could be."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        os.fsync(fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
