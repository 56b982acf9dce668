"""The pools a daemon maps are those the
kernel keeps mapped. Each case is what a hostile scheduler hands over."""

import ctypes
import fcntl
import os

import pytest

from cpcache.dataplane import memfd
from cpcache.dataplane.pools import DevicePool
from cpcache.errors import CacheError, FailedPrecondition, InvalidArgument
from cpcache.geometry import KVGeometry

pytestmark = pytest.mark.timeout(30)

GEOMETRY = KVGeometry(layers=2, kv_kind="mha", heads=1, head_dim=16, dtype="bfloat16", page_size=16)
HUGE_PAGE = 2 << 20
PAGES = HUGE_PAGE // GEOMETRY.page_bytes  # a pool of exactly one huge page
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2


def sealed(flags: int = 0, seals: int = memfd.REQUIRED_SEALS, pages: int = PAGES) -> int:
    fd = os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | flags)
    os.ftruncate(fd, GEOMETRY.page_bytes * pages)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_a_hugetlb_memfd_is_refused_before_any_mapping():
    """Sealed against shrinking, of the right size, yet a hole
    punched in it and no free huge page would SIGBUS the daemon."""
    try:
        fd = sealed(os.MFD_HUGETLB)
    except OSError as exc:
        pytest.skip(f"no hugetlbfs memfd here: {exc}")
    with pytest.raises(FailedPrecondition, match="hugetlbfs"):
        DevicePool.from_fd(fd, GEOMETRY, PAGES)


def test_a_hole_punched_in_a_shmem_pool_reads_back_as_zeros():
    """Why shmem is enough: the creator can punch a hole (only F_SEAL_WRITE
    would stop it), and the daemon then reads zeros, not SIGBUS."""
    fd = sealed()
    mine = os.dup(fd)
    pool = DevicePool.from_fd(fd, GEOMETRY, PAGES)
    pool.tensor.view(-1).fill_(1)
    libc = ctypes.CDLL(None, use_errno=True)
    punched = libc.fallocate(mine, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, ctypes.c_long(0),
                             ctypes.c_long(HUGE_PAGE))
    assert punched == 0, os.strerror(ctypes.get_errno())
    assert int(pool.tensor.view(-1).abs().sum()) == 0
    os.close(mine)


@pytest.mark.parametrize("seals", [fcntl.F_SEAL_WRITE, memfd.F_SEAL_FUTURE_WRITE])
def test_a_write_sealed_memfd_is_a_typed_refusal(seals):
    """It used to reach mmap and answer INTERNAL."""
    with pytest.raises(FailedPrecondition, match="sealed against writing"):
        DevicePool.from_fd(sealed(seals=memfd.REQUIRED_SEALS | seals), GEOMETRY, PAGES)


def test_a_memfd_sealed_against_shrinking_only_is_refused():
    with pytest.raises(FailedPrecondition, match="shrinking and growing"):
        DevicePool.from_fd(sealed(seals=fcntl.F_SEAL_SHRINK), GEOMETRY, PAGES)


def test_seals_are_read_before_the_size(monkeypatch):
    """The creator truncates and then seals while the daemon
    checks. Read in that order, the size seen is the size for good: a typed
    refusal, never a mapping past the end nor an INTERNAL."""
    fd = sealed(seals=0)
    real = fcntl.fcntl

    def racing(fd_: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_GET_SEALS:  # the race: truncated, then sealed, just before the daemon looks
            os.ftruncate(fd_, GEOMETRY.page_bytes)
            real(fd_, fcntl.F_ADD_SEALS, memfd.REQUIRED_SEALS)
        return real(fd_, cmd, arg)

    monkeypatch.setattr(memfd.fcntl, "fcntl", racing)
    with pytest.raises(InvalidArgument, match="need .* bytes, but the pool holds"):
        DevicePool.from_fd(fd, GEOMETRY, PAGES)


@pytest.mark.parametrize("make", ["pipe", "socket", "dir", "devnull", "plain-tmpfs"])
def test_every_other_kind_of_descriptor_is_a_typed_refusal(make, tmp_path):
    if make == "pipe":
        fd, other = os.pipe()
        os.close(other)
    elif make == "socket":
        import socket
        fd = socket.socket().detach()
    elif make == "dir":
        fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    elif make == "devnull":
        fd = os.open(os.devnull, os.O_RDWR)
    else:  # a tmpfs file that is not a memfd cannot be sealed
        shm = os.open("/dev/shm", os.O_RDONLY)
        try:
            if memfd.filesystem_magic(shm) != memfd.TMPFS_MAGIC:
                pytest.skip("/dev/shm is not tmpfs here")
        finally:
            os.close(shm)
        fd = os.open(f"/dev/shm/cpc-{os.getpid()}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(f"/dev/shm/cpc-{os.getpid()}")
        os.ftruncate(fd, GEOMETRY.page_bytes * PAGES)
    with pytest.raises(CacheError) as info:
        DevicePool.from_fd(fd, GEOMETRY, PAGES)
    assert type(info.value) in (InvalidArgument, FailedPrecondition)
