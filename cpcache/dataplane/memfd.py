"""What makes a handed-over pool safe to map: the kernel's guarantees, not
the caller's word.

The daemon maps a pool that its creator keeps writing. A shared mapping
dies of SIGBUS when the memory behind it goes away, which a file can do in
two ways: it shrinks, or a hole is punched in it (fallocate PUNCH_HOLE) and
the page cannot be found again. So a pool must be:

- a shmem memfd (`fstatfs` says TMPFS_MAGIC). A hole punched in shmem reads
  back as zeros, a new page faulted in like any other: the creator can zero
  its own pool, nothing more. hugetlbfs is refused: there a hole is refilled
  only from the free huge pages, and a caller who takes them all makes the
  daemon's next access SIGBUS. On both, only F_SEAL_WRITE stops a hole
  punch, and a write-sealed pool is of no use (the daemon loads pages into
  it), so the file system is what decides;
- sealed against shrinking and growing (F_SEAL_SHRINK | F_SEAL_GROW), seals
  read before the size, so the size checked is the size for good;
- not write-sealed (F_SEAL_WRITE, F_SEAL_FUTURE_WRITE): the daemon could not
  map it for writing.

Every refusal is a typed error naming the rule.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import stat

from cpcache.errors import FailedPrecondition, InvalidArgument

TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6
F_SEAL_FUTURE_WRITE = 0x0010  # not in Python's fcntl module
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
WRITE_SEALS = fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE

_libc = ctypes.CDLL(None, use_errno=True)
_STATFS_BYTES = 256  # struct statfs is 120 bytes on 64-bit Linux; f_type (a long) comes first


def filesystem_magic(fd: int) -> int:
    """`f_type` of the file system holding `fd` (fstatfs(2))."""
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int.from_bytes(buf.raw[: ctypes.sizeof(ctypes.c_long)], "little") & 0xFFFFFFFF


def check_kind(fd: int) -> None:
    """Refuse any descriptor that is not a shmem regular file. Cheap and
    non-blocking: the handover runs it before it keeps a descriptor."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise InvalidArgument("attach: the pool descriptor is not a regular file (a memfd)")
    magic = filesystem_magic(fd)
    if magic == HUGETLBFS_MAGIC:
        raise FailedPrecondition(
            "attach: a hugetlbfs pool (MFD_HUGETLB) is refused: a hole punched in it is refilled only from "
            "the free huge pages, and without one the daemon dies of SIGBUS; create the memfd without "
            "MFD_HUGETLB (DevicePool.create_sealed does)")
    if magic != TMPFS_MAGIC:
        raise FailedPrecondition(
            f"attach: the pool must be a shmem memfd (file system 0x{magic:x} is not tmpfs); "
            "DevicePool.create_sealed makes one")


def check_pool(fd: int, need: int | None, what: str = "pool") -> int:
    """Everything `check_kind` checks, then the access mode, the seals and
    (only then, once it can no longer change) the size: exactly `need`
    bytes, or any (None: the regions in it are checked against it). -> the
    size."""
    check_kind(fd)
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise InvalidArgument(f"attach: the {what} descriptor must be open for reading and writing")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & WRITE_SEALS:
        raise FailedPrecondition(
            f"attach: the {what} is sealed against writing (F_SEAL_WRITE or F_SEAL_FUTURE_WRITE), but the daemon "
            "writes loaded pages into it; seal it with F_SEAL_SHRINK | F_SEAL_GROW only")
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise FailedPrecondition(
            f"attach: the {what} must be a memfd sealed against shrinking and growing (F_SEAL_SHRINK | "
            f"F_SEAL_GROW): a {what} that shrinks under the daemon would kill it (DevicePool.create_sealed "
            "makes one)")
    size = os.fstat(fd).st_size  # after the seals: it cannot change any more
    if need is not None and size != need:
        raise InvalidArgument(f"attach: the pages attached need {need} bytes, but the {what} holds {size}")
    if size == 0:
        raise InvalidArgument(f"attach: the {what}'s memfd is empty")
    return size
