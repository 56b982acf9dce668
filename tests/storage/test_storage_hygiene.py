"""Shared-storage hygiene, on real files and real processes:
damaged pages are deleted and rewritten, killed writers' temp files are
swept and counted, capacity holds for the whole shared root, pages are
renamed into place (and, when durable, fsynced before they count as
stored), and Mooncake objects are checked like files."""

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from cpcache.dataplane.movers import Tiers
from cpcache.dataplane.pools import HostPool
from cpcache.dataplane.storage import file as file_storage
from cpcache.dataplane.storage import mooncake as mooncake_storage
from cpcache.dataplane.storage import open_backend
from cpcache.dataplane.storage.framing import HEADER, pack_header
from cpcache.dataplane.storage.mooncake import HEADERS_PER_LEASE, NO_AVAILABLE_HANDLE
from cpcache.geometry import KVGeometry

pytestmark = pytest.mark.timeout(90)

GEOMETRY = KVGeometry(layers=2, kv_kind="mha", heads=1, head_dim=16, dtype="bfloat16", page_size=16)
PAGE_FILE = HEADER.size + GEOMETRY.page_bytes


def backend_at(root, **options):
    return open_backend("file", root=str(root), geometry_fingerprint=GEOMETRY.fingerprint(),
                        page_bytes=GEOMETRY.page_bytes, **options)


def host_with_pages(n):
    host = HostPool(GEOMETRY, pages=n)
    host.tensor.view(-1).view(torch.uint8).copy_(torch.arange(host.nbytes) % 251)
    return Tiers(host)


def pages_on_disk(root):
    return sorted(e.name for d in os.scandir(root) if d.is_dir() for e in os.scandir(d.path)
                  if not e.name.startswith("."))


# -- damaged pages -----------------------------------------------------------------------


def test_a_truncated_page_is_no_hit_and_the_next_backup_rewrites_it(tmp_path):
    """What power loss after a rename used to leave: the page and the rest
    of its chain were a permanent miss while backups reported stored."""
    tiers = host_with_pages(3)
    backend = backend_at(tmp_path / "store")
    keys = ["k0", "k1", "k2"]
    assert backend.put_from(keys, tiers.host_buffers(range(3))) == [True] * 3
    os.truncate(backend.path("k1"), PAGE_FILE // 2)
    assert backend.exists_prefix(keys) == 1  # a lookup no longer promises it
    assert backend.put_from(keys, tiers.host_buffers(range(3))) == [True] * 3  # put-if-absent does not skip it
    assert os.path.getsize(backend.path("k1")) == PAGE_FILE
    assert backend.get_into(keys, tiers.host_buffers(range(3))) == [True] * 3


def test_a_corrupt_page_is_deleted_on_read_and_rewritten(tmp_path):
    tiers = host_with_pages(2)
    backend = backend_at(tmp_path / "store")
    assert backend.put_from(["a", "b"], tiers.host_buffers([0, 1])) == [True, True]
    with open(backend.path("b"), "r+b") as fh:  # one flipped bit in the payload
        fh.seek(HEADER.size + 7)
        byte = fh.read(1)[0]
        fh.seek(HEADER.size + 7)
        fh.write(bytes([byte ^ 1]))
    with open(backend.path("a"), "r+b") as fh:  # a header that is not ours
        fh.write(b"NOTAPAGE")
    assert backend.get_into(["a", "b"], tiers.host_buffers([0, 1])) == [False, False]
    assert not os.path.exists(backend.path("a")) and not os.path.exists(backend.path("b"))
    assert backend.counters()["storage_damaged_pages_deleted"] == 2
    assert backend.put_from(["a", "b"], tiers.host_buffers([0, 1])) == [True, True]
    assert backend.get_into(["a", "b"], tiers.host_buffers([0, 1])) == [True, True]


def test_a_page_with_trailing_bytes_is_no_hit_is_deleted_and_rewritten(tmp_path):
    tiers = host_with_pages(2)
    backend = backend_at(tmp_path / "store")
    assert backend.put_from(["a", "b"], tiers.host_buffers([0, 1])) == [True, True]
    with open(backend.path("b"), "ab") as fh:  # a whole page, and then some
        fh.write(b"x")
    assert backend.get_into(["a", "b"], tiers.host_buffers([0, 1])) == [True, False]
    assert not os.path.exists(backend.path("b")) and backend.counters()["storage_damaged_pages_deleted"] == 1
    assert backend.put_from(["b"], tiers.host_buffers([1])) == [True]
    assert backend.get_into(["b"], tiers.host_buffers([1])) == [True]


def test_a_damaged_page_that_cannot_be_deleted_is_a_miss_and_the_batch_goes_on(tmp_path, monkeypatch):
    """A read-only root: the damaged page stays, uncounted, and the rest of
    the batch reads (a failure is data, never an exception from an I/O thread)."""
    tiers = host_with_pages(3)
    backend = backend_at(tmp_path / "store")
    assert backend.put_from(["a", "b", "c"], tiers.host_buffers(range(3))) == [True] * 3
    os.truncate(backend.path("b"), PAGE_FILE - 1)

    def read_only(path, *args, **kwargs):
        raise PermissionError(f"read-only file system: {path}")

    monkeypatch.setattr(file_storage.os, "unlink", read_only)
    assert backend.get_into(["a", "b", "c"], tiers.host_buffers(range(3))) == [True, False, True]
    assert os.path.exists(backend.path("b")) and backend.counters().get("storage_damaged_pages_deleted", 0) == 0


def syscalls(monkeypatch, by_thread: dict[str, list[str]] | None = None) -> list[str]:
    """The syscalls that order a put, in the order made (and, in
    `by_thread`, per thread: a batch's pages are written in parallel)."""
    calls: list[str] = []

    def record(name: str) -> None:
        calls.append(name)
        if by_thread is not None:
            by_thread.setdefault(threading.current_thread().name, []).append(name)

    for name in ("fdatasync", "fsync", "replace"):
        real = getattr(os, name)
        monkeypatch.setattr(file_storage.os, name, lambda *a, _real=real, _name=name: (record(_name), _real(*a))[1])
    return calls


def test_a_durable_page_is_fsynced_before_its_rename_and_its_directory_after(tmp_path, monkeypatch):
    by_thread: dict[str, list[str]] = {}
    calls = syscalls(monkeypatch, by_thread)
    tiers = host_with_pages(2)
    backend = backend_at(tmp_path / "store", durable=True)
    assert backend.put_from(["pa0", "pa1"], tiers.host_buffers([0, 1])) == [True, True]
    # Each page's data before its rename (each page is written on one thread);
    # one directory sync for the batch (same fan-out dir), after every rename.
    writers = [names for names in by_thread.values() if "replace" in names]
    assert sorted(writers) in ([["fdatasync", "replace"], ["fdatasync", "replace"]],
                               [["fdatasync", "replace", "fdatasync", "replace"]])
    assert sorted(calls) == ["fdatasync", "fdatasync", "fsync", "replace", "replace"] and calls[-1] == "fsync"


def test_by_default_a_page_is_renamed_into_place_unsynced_and_reads_back_whole(tmp_path, monkeypatch):
    calls = syscalls(monkeypatch)
    tiers = host_with_pages(2)
    backend = backend_at(tmp_path / "store")
    assert backend.put_from(["pa0", "pa1"], tiers.host_buffers([0, 1])) == [True, True]
    assert calls == ["replace", "replace"]
    assert backend.get_into(["pa0", "pa1"], tiers.host_buffers([1, 0])) == [True, True]


# -- temp files of killed writers ---------------------------------------------------------


WRITER = textwrap.dedent("""
    import os, sys, torch
    from cpcache.dataplane.movers import Tiers
    from cpcache.dataplane.pools import HostPool
    from cpcache.dataplane.storage import file as file_storage, open_backend
    from cpcache.geometry import KVGeometry

    geometry = KVGeometry(layers=2, kv_kind="mha", heads=1, head_dim=16, dtype="bfloat16", page_size=16)
    real_writev = os.writev

    def half_then_hang(fd, buffers):  # a writer killed mid-page: half its bytes are on disk
        written = os.write(fd, bytes(buffers[0])[:20])
        print("writing", flush=True)
        sys.stdin.read()
        return written

    file_storage.os.writev = half_then_hang
    backend = open_backend("file", root=sys.argv[1], geometry_fingerprint=geometry.fingerprint())
    host = HostPool(geometry, pages=1)
    backend.put_from([sys.argv[2]], Tiers(host).host_buffers([0]))
""")


def start_writer(root, key):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), key], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "writing\n"  # its temp file exists now
    return proc


def temp_files(root):
    return sorted(e.name for d in os.scandir(root) if d.is_dir() for e in os.scandir(d.path)
                  if e.name.endswith(".tmp"))


def test_killed_writers_temp_files_are_swept_at_start_and_counted(tmp_path):
    root = tmp_path / "store"
    writers = [start_writer(root, key) for key in ("dead0", "dead1", "dead2", "live")]
    killed, live = writers[:3], writers[3]
    for proc in killed:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    try:
        assert len(temp_files(root)) == 4
        backend = backend_at(root)
        counters = backend.counters()
        assert counters["storage_tmp_swept_files"] == 3 and counters["storage_tmp_swept_bytes"] == 3 * 20
        assert [name.split(".")[1] for name in temp_files(root)] == ["live"]  # a live writer's is kept
    finally:
        live.kill()
        live.wait(timeout=30)
        live.stdin.close()
        live.stdout.close()
    for proc in killed:
        proc.stdin.close()
        proc.stdout.close()


def test_the_sweep_deletes_only_files_named_like_its_own_temp_files(tmp_path):
    """A dot-file the daemon never wrote (a `.gitattributes`
    beside the pages) is kept however old; an old temp file of its own name
    pattern, from any host, is swept."""
    root = tmp_path / "store"
    (root / "ab").mkdir(parents=True)
    foreign = root / "ab" / ".gitattributes"
    foreign.write_text("*.bin filter=lfs\n")
    old_tmp = root / "ab" / ".abkey.0badc0de-1-0123abcd.tmp"  # another host's, long dead
    old_tmp.write_bytes(b"x" * 7)
    hour_ago = os.stat(foreign).st_mtime - 3600
    for path in (foreign, old_tmp):
        os.utime(path, (hour_ago, hour_ago))
    counters = backend_at(root).counters()
    assert foreign.exists() and not old_tmp.exists()
    assert counters["storage_tmp_swept_files"] == 1 and counters["storage_tmp_swept_bytes"] == 7


# -- capacity for the whole shared root ------------------------------------------------------


def test_capacity_holds_for_the_root_shared_by_two_daemons(tmp_path):
    root = tmp_path / "store"
    tiers = host_with_pages(20)
    capacity = 20 * PAGE_FILE
    a, b = backend_at(root, capacity_bytes=capacity), backend_at(root, capacity_bytes=capacity)
    for i in range(20):  # the two ranks write alternately, 20 pages each
        assert a.put_from([f"a{i}"], tiers.host_buffers([i])) == [True]
        assert b.put_from([f"b{i}"], tiers.host_buffers([i])) == [True]
        a.wait_evictions()  # eviction runs on each daemon's own thread, after its put
        b.wait_evictions()
    on_disk = pages_on_disk(root)
    assert len(on_disk) * PAGE_FILE <= capacity + PAGE_FILE  # one page over at most, between rescans
    assert {f"a{i}" for i in range(15, 20)} <= set(on_disk)  # the most recent of each survive
    assert {f"b{i}" for i in range(15, 20)} <= set(on_disk)


def test_a_restarted_rank_evicts_the_oldest_pages_not_the_other_ranks_recent_ones(tmp_path):
    root = tmp_path / "store"
    tiers = host_with_pages(20)
    capacity = 20 * PAGE_FILE
    a = backend_at(root, capacity_bytes=capacity)
    assert all(a.put_from([f"a{i}"], tiers.host_buffers([i]))[0] for i in range(20))
    recent = [f"a{i}" for i in range(5)]  # rank A's oldest writes, but it just read them: hot
    assert a.get_into(recent, tiers.host_buffers(range(5))) == [True] * 5
    a.wait_evictions()  # rank A's own eviction (on its thread) is done before B restarts
    restarted = backend_at(root, capacity_bytes=capacity)  # rank B, restarted, knows nothing of A's reads
    assert all(restarted.put_from([f"b{i}"], tiers.host_buffers([i]))[0] for i in range(5))
    restarted.wait_evictions()
    on_disk = set(pages_on_disk(root))
    assert set(recent) <= on_disk
    assert not {f"a{i}" for i in range(5, 10)} & on_disk  # the coldest went
    assert a.exists_prefix(recent) == 5


# -- Mooncake objects are checked like files ---------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("parallel", [False, True], ids=["hashed in turn", "hashed on the checking threads"])
def test_mooncake_reads_check_header_geometry_and_checksum(mooncake_master, monkeypatch, parallel):
    if parallel:  # every page size takes the large pages' path
        monkeypatch.setattr(mooncake_storage, "PARALLEL_CHECK_MIN_PAGE_BYTES", 0)
    tiers = host_with_pages(4)
    host = tiers.host
    store = open_backend("mooncake", master=mooncake_master.master, metadata_server=mooncake_master.metadata_server,
                         buffers=[(host.tensor.data_ptr(), host.nbytes)], geometry_fingerprint=GEOMETRY.fingerprint())
    other = KVGeometry(layers=2, kv_kind="mha", heads=1, head_dim=16, dtype="float16", page_size=16)
    foreign = open_backend("mooncake", master=mooncake_master.master, metadata_server=mooncake_master.metadata_server,
                           buffers=[(host.tensor.data_ptr(), host.nbytes)], geometry_fingerprint=other.fingerprint())
    try:
        pages = tiers.host_buffers(range(4))
        good, second, unframed, flipped = (f"mc-{name}-{parallel}" for name in ("good", "second", "raw", "flipped"))
        assert store.put_from([good, second], pages[:2]) == [True, True]
        # An unframed object of exactly a page's size (what the old read path took as valid KV).
        raw = store._store
        assert raw.batch_put_from([unframed], [pages[2].addresses[0]], [pages[2].nbytes]) == [0]
        # A framed object whose payload does not match its checksum.
        corrupt = bytearray(pack_header(GEOMETRY.fingerprint(), bytes(pages[3].nbytes)))
        corrupt += bytes([1]) + bytes(pages[3].nbytes - 1)
        assert raw.put(flipped, bytes(corrupt)) == 0
        # One batch: each page meets its own verdict.
        assert store.get_into([second, unframed, good, flipped], pages) == [True, False, True, False]
        assert store.counters()["storage_damaged_pages_deleted"] == 1
        assert store.exists_prefix([flipped]) == 0  # removed: the next backup rewrites it
        assert foreign.get_into([good], pages[:1]) == [False]  # another geometry's reader
    finally:
        store.close()
        foreign.close()


@pytest.mark.timeout(120)
def test_mooncake_batches_past_one_header_lease_check_each_page_against_its_own_header(mooncake_master):
    """A batch larger than HEADERS_PER_LEASE goes in parts through one lease
    of the header arena: read back in another order, every page must meet
    its own header (a header shifted by one part fails its checksum)."""
    n = HEADERS_PER_LEASE + 7
    tiers = host_with_pages(n)
    host = tiers.host
    store = open_backend("mooncake", master=mooncake_master.master, metadata_server=mooncake_master.metadata_server,
                         buffers=[(host.tensor.data_ptr(), host.nbytes)], geometry_fingerprint=GEOMETRY.fingerprint())
    try:
        keys = [f"lease-{i}" for i in range(n)]
        assert store.put_from(keys, tiers.host_buffers(range(n))) == [True] * n
        expected = host.tensor.clone()
        host.tensor.zero_()
        assert store.get_into(keys[::-1], tiers.host_buffers(range(n))[::-1]) == [True] * n
        assert torch.equal(host.tensor, expected)
    finally:
        store.close()


@pytest.mark.timeout(120)
def test_a_full_mooncake_store_evicts_and_takes_the_refused_pages_on_a_later_try(tmp_path):
    """A store with room for 256 pages is put 8 x 48: its master refuses pages
    for space and evicts a few percent per pass, and the backend puts the
    refused pages again after a wait, until they are taken: each batch is
    stored whole (the master's own eviction may drop any of them later),
    the retries are counted and the store stays within its bytes."""
    from cpcache.testing.mooncake_master import MooncakeMaster

    geometry = KVGeometry(layers=4, kv_kind="mha", heads=8, head_dim=128, dtype="bfloat16", page_size=4)  # 64 KiB
    host = HostPool(geometry, pages=48, layout="page_first_direct")
    tiers = Tiers(host)
    master = MooncakeMaster(tmp_path / "master.log").start()
    try:
        store = open_backend("mooncake", master=master.master, metadata_server=master.metadata_server,
                             buffers=[(host.address, host.nbytes)], geometry_fingerprint=geometry.fingerprint(),
                             global_segment_size=256 * geometry.page_bytes,  # Mooncake's least: 16 MiB
                             local_buffer_size=16 << 20,
                             space_retry_waits_s=[0.05] * 40)
        try:
            for batch in range(8):
                keys = [f"full-{batch}-{i}" for i in range(48)]
                assert store.put_from(keys, tiers.host_buffers(range(48))) == [True] * 48
            counters = store.counters()
            assert counters["storage_put_space_retries"] > 0  # the store was full, and took them later
            assert counters["storage_puts_refused_for_space"] == 0
            assert master.metrics()["master_allocated_bytes"] <= 256 * geometry.page_bytes
        finally:
            store.close()
    finally:
        master.stop()


class RefusingStore:
    """A real Mooncake store whose next `refusals` put calls are refused for
    space (every page), as a full store refuses them; `called` is set at each."""

    def __init__(self, real, refusals):
        self.real, self.refusals, self.calls = real, refusals, 0
        self.called = threading.Event()

    def batch_put_from_multi_buffers(self, keys, pointers, sizes):
        self.calls += 1
        self.called.set()
        if self.refusals:
            self.refusals -= 1
            return [NO_AVAILABLE_HANDLE] * len(keys)
        return self.real.batch_put_from_multi_buffers(keys, pointers, sizes)

    def __getattr__(self, name):
        return getattr(self.real, name)


def refusing_backend(mooncake_master, tiers, refusals, waits):
    store = open_backend("mooncake", master=mooncake_master.master, metadata_server=mooncake_master.metadata_server,
                         buffers=[(tiers.host.tensor.data_ptr(), tiers.host.nbytes)],
                         geometry_fingerprint=GEOMETRY.fingerprint(), space_retry_waits_s=waits)
    store._store = RefusingStore(store._store, refusals)
    return store


@pytest.mark.timeout(120)
def test_refused_puts_are_tried_again_then_given_up_and_a_store_still_full_is_not_waited_on(mooncake_master):
    tiers = host_with_pages(2)
    store = refusing_backend(mooncake_master, tiers, refusals=2, waits=[0.001, 0.001])
    try:
        # Refused twice, taken the third time: stored.
        assert store.put_from(["room-0", "room-1"], tiers.host_buffers([0, 1])) == [True, True]
        assert store._store.calls == 3 and store.counters()["storage_put_space_retries"] == 2
        # Refused every time: given up after the waits, a failed put, counted.
        store._store.refusals = 10
        assert store.put_from(["room-2", "room-3"], tiers.host_buffers([0, 1])) == [False, False]
        counters = store.counters()
        assert counters["storage_put_space_retries"] == 4 and counters["storage_puts_refused_for_space"] == 2
        # The store stayed full through them: the next put is not waited on.
        calls = store._store.calls
        assert store.put_from(["room-4"], tiers.host_buffers([0])) == [False]
        assert store._store.calls == calls + 1 and store.counters()["storage_put_space_retries"] == 4
        assert store.exists_prefix(["room-0", "room-1"]) == 2
    finally:
        store.close()


@pytest.mark.timeout(120)
def test_closing_the_backend_cuts_a_wait_for_room_short(mooncake_master):
    tiers = host_with_pages(1)
    store = refusing_backend(mooncake_master, tiers, refusals=100, waits=[600.0])
    outcome = []
    putter = threading.Thread(target=lambda: outcome.append(store.put_from(["cut"], tiers.host_buffers([0]))))
    putter.start()
    assert store._store.called.wait(30)  # refused once: now waiting for room
    store.close()
    putter.join(30)
    assert not putter.is_alive() and outcome == [[False]]
    assert store._store.calls == 1  # no put after the close
