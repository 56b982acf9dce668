"""Pages move bit-exact device -> host -> storage -> host -> device, for
every host layout, MHA, MLA and DSA (MLA with its indexer's part beside the
KV: every part of a page moves), with the file backend (the same round trip
with Mooncake Store on a real mooncake_master is
tests/storage/test_mooncake_round_trip.py)."""

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from cpcache.dataplane.movers import DEVICE, HOST, STORAGE, Tiers, Transfers
from cpcache.dataplane.pools import DevicePool, HostPool
from cpcache.dataplane.storage import StorageBackend, open_backend
from cpcache.dataplane.storage.faults import FaultyBackend, StorageFaults
from cpcache.dataplane.storage.framing import HEADER, Verdict, check_page, check_pages, in_spans, pack_header
from cpcache.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from cpcache.geometry import KVGeometry, PagePart
from cpcache.host_layout import LAYOUTS
from cpcache.state.allocator import PageAllocator

pytestmark = pytest.mark.timeout(60)

GEOMETRIES = {
    "mha": KVGeometry(layers=3, kv_kind="mha", heads=2, head_dim=8, dtype="bfloat16", page_size=4),
    "mla": KVGeometry(layers=3, kv_kind="mla", heads=1, head_dim=24, dtype="float16", page_size=8),
    "dsa": KVGeometry(layers=3, kv_kind="mla", heads=1, head_dim=24, dtype="bfloat16", page_size=8,
                      beside=(PagePart("indexer", rows_per_page=1, width=8 * 132, dtype="uint8"),)),
}


def fill_random(pool: DevicePool, seed: int) -> None:
    for part in pool.parts:
        raw = part.tensor.view(-1).view(torch.uint8)
        raw.copy_(torch.from_numpy(np.random.default_rng(seed).integers(0, 256, raw.numel(), dtype=np.uint8)))
        seed += 1


def page_of(pool: DevicePool, page: int) -> list[torch.Tensor]:
    """Every part of one device page, as bytes."""
    return [part.tensor[:, :, page * part.geometry.page_size : (page + 1) * part.geometry.page_size]
            .contiguous().view(torch.uint8) for part in pool.parts]


def zero(pool: DevicePool | HostPool) -> None:
    for part in pool.parts:
        part.tensor.zero_()


def make_backend(kind, tmp_path, geometry, host, master=None) -> StorageBackend:
    if kind == "file":
        return open_backend("file", root=str(tmp_path / "store"), geometry_fingerprint=geometry.fingerprint())
    return open_backend(
        "mooncake", master=master.master, metadata_server=master.metadata_server,
        buffers=[(host.tensor.data_ptr(), host.nbytes)],
    )


@pytest.fixture
def backend_kind():
    """The file backend here; tests/storage runs the same test with "mooncake"."""
    return "file"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv", ["mha", "mla", "dsa"])
def test_round_trip_is_bit_exact(tmp_path, backend_kind, request, layout, kv):
    geometry = GEOMETRIES[kv]
    device = DevicePool.create_sealed(geometry, pages=16)
    fill_random(device, seed=len(layout) + len(kv))
    original = [page_of(device, p) for p in range(16)]
    host = HostPool(geometry, pages=8, layout=layout)
    master = request.getfixturevalue("mooncake_master") if backend_kind == "mooncake" else None
    tiers = Tiers(host, device, make_backend(backend_kind, tmp_path, geometry, host, master))
    transfers = Transfers(tiers, threads=2)
    try:
        keys = [f"k{backend_kind}_{layout}_{kv}_{i}" for i in range(5)]
        device_pages, slots = [9, 2, 3, 4, 15], [7, 0, 1, 2, 5]
        assert transfers.submit((DEVICE, HOST), device_pages, slots).result().success
        assert transfers.submit((HOST, STORAGE), slots, keys).result().success
        zero(host)
        assert tiers.storage.exists_prefix(keys + ["absent"]) == 5
        back_slots = [3, 4, 5, 6, 0]
        result = transfers.submit((STORAGE, HOST), keys, back_slots).result()
        assert result.success and result.pages_done == 5
        zero(device)
        assert transfers.submit((HOST, DEVICE), back_slots, device_pages).result().success
        for p in device_pages:
            for part, (now, before) in zip(geometry.part_names, zip(page_of(device, p), original[p])):
                assert torch.equal(now, before), f"page {p}'s {part} differs"
        untouched = [p for p in range(16) if p not in device_pages]
        assert all(part.count_nonzero() == 0 for p in untouched for part in page_of(device, p))
        assert transfers.pages_moved[(STORAGE, HOST)] == 5
    finally:
        transfers.close()


def write_pages(tmp_path, keys, geometry=GEOMETRIES["mha"]):
    host = HostPool(geometry, pages=len(keys))
    host.tensor.view(-1).view(torch.uint8).copy_(torch.arange(host.nbytes) % 251)
    backend = open_backend("file", root=str(tmp_path / "store"), geometry_fingerprint=geometry.fingerprint())
    tiers = Tiers(host, storage=backend)
    assert backend.put_from(keys, tiers.host_buffers(range(len(keys)))) == [True] * len(keys)
    return backend, tiers


def test_corrupt_truncated_and_foreign_pages_read_as_misses(tmp_path):
    keys = ["good", "corrupt", "truncated", "foreign"]
    backend, tiers = write_pages(tmp_path, keys)
    with open(backend.path("corrupt"), "r+b") as fh:
        fh.seek(100)
        byte = fh.read(1)
        fh.seek(100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with open(backend.path("truncated"), "r+b") as fh:
        fh.truncate(os.path.getsize(backend.path("truncated")) - 1)
    other = KVGeometry(layers=3, kv_kind="mha", heads=2, head_dim=8, dtype="float16", page_size=4)
    foreign = open_backend("file", root=str(tmp_path / "store"), geometry_fingerprint=other.fingerprint())
    assert foreign.get_into(["good"], tiers.host_buffers([0])) == [False]
    assert backend.get_into(keys, tiers.host_buffers(range(4))) == [True, False, False, True]


@pytest.mark.parametrize("key", ["../escape", "a/../../etc", "/etc/passwd", "..", ".hidden", "a/b", "", "x" * 300])
def test_keys_that_could_escape_the_root_are_refused(tmp_path, key):
    backend, tiers = write_pages(tmp_path, ["ok"])
    with pytest.raises(InvalidArgument, match="not a plain name"):
        backend.put_from([key], tiers.host_buffers([0]))
    assert sorted(os.listdir(tmp_path)) == ["store"]


def bounded_to_three_pages(tmp_path) -> tuple[StorageBackend, Tiers, int]:
    """A file store of 3 pages' capacity, a host pool of 4 pages, and a stored page's size."""
    geometry = GEOMETRIES["mha"]
    page_file = geometry.page_bytes + HEADER.size
    backend = open_backend("file", root=str(tmp_path / "s"), geometry_fingerprint=geometry.fingerprint(),
                           capacity_bytes=3 * page_file)
    return backend, Tiers(HostPool(geometry, pages=4), storage=backend), page_file


def test_capacity_evicts_least_recently_used(tmp_path):
    keys = [f"p{i}" for i in range(4)]
    backend, tiers, page_file = bounded_to_three_pages(tmp_path)
    backend.put_from(keys[:3], tiers.host_buffers([0, 1, 2]))
    backend.wait_evictions()
    backend.get_into(["p0"], tiers.host_buffers([0]))  # p0 is now the most recent
    backend.put_from(["p3"], tiers.host_buffers([3]))
    backend.wait_evictions()  # eviction runs on its own thread, after the put
    assert [backend.exists_prefix([k]) for k in keys] == [1, 0, 1, 1]
    assert backend.used_bytes == 3 * page_file


@pytest.mark.parametrize("tokens_per_page", [16, 1024], ids=["small pages, read in turn", "256 KiB pages, in parallel"])
def test_a_read_batch_stamps_recency_in_its_order(tmp_path, tokens_per_page):
    """Read in another order than written, the pages become recent in the
    read's order, whichever I/O thread reads which: the files' mtimes (which
    every daemon on the root evicts by) and this daemon's index alike, so
    the capacity evicts the page read first before the ones read after."""
    geometry = KVGeometry(layers=2, kv_kind="mha", heads=2, head_dim=16, dtype="bfloat16", page_size=tokens_per_page)
    page_file = geometry.page_bytes + HEADER.size
    backend = open_backend("file", root=str(tmp_path / "s"), geometry_fingerprint=geometry.fingerprint(),
                           capacity_bytes=3 * page_file, page_bytes=geometry.page_bytes)
    tiers = Tiers(HostPool(geometry, pages=4, layout="page_first_direct"), storage=backend)
    keys = [f"r{i}" for i in range(4)]
    backend.put_from(keys[:3], tiers.host_buffers([0, 1, 2]))
    backend.wait_evictions()
    order = ["r2", "r0", "r1"]
    assert backend.get_into(order, tiers.host_buffers([0, 1, 2])) == [True] * 3
    mtimes = [os.stat(backend.path(k)).st_mtime_ns for k in order]
    assert mtimes == sorted(mtimes)
    backend.put_from(["r3"], tiers.host_buffers([3]))
    backend.wait_evictions()
    assert [backend.exists_prefix([k]) for k in keys] == [1, 1, 0, 1]  # r2, read first, went first


def test_a_batch_of_headers_is_checked_page_by_page():
    """check_pages over one batch: each page meets its own header, whatever
    its neighbours are (valid, another geometry's, torn, corrupt, short)."""
    geometry = 7
    payloads = [[memoryview(bytes([i]) * 24), memoryview(bytes([i + 1]) * 8)] for i in range(6)]
    headers = [pack_header(geometry, p) for p in payloads]
    headers[1] = pack_header(geometry + 1, payloads[1])  # another geometry's page: foreign, kept
    headers[2] = b"NOTAPAGE" + headers[2][8:]  # not a page
    headers[3] = pack_header(geometry, payloads[3], digest=1)  # bytes that do not match their checksum
    headers[4] = pack_header(geometry, [memoryview(bytes(16))])  # a header that promises other bytes
    read_whole = [True] * 5 + [False]  # the last object was shorter than a page
    verdicts = check_pages(b"".join(headers), payloads, [32] * 6, read_whole, geometry)
    assert verdicts == [Verdict.VALID, Verdict.FOREIGN, Verdict.DAMAGED, Verdict.DAMAGED, Verdict.DAMAGED,
                        Verdict.DAMAGED]
    assert verdicts[0] == check_page(headers[0], payloads[0], geometry)
    with ThreadPoolExecutor(2) as workers:  # hashed in runs of pages at once: the same verdicts
        for spans in (2, 3, 4):
            assert check_pages(b"".join(headers), payloads, [32] * 6, read_whole, geometry, workers, spans) == verdicts


def test_runs_of_work_keep_their_order_and_a_shut_down_pool_leaves_them_to_the_caller():
    items = list(range(11))
    with ThreadPoolExecutor(3) as workers:
        for spans in (1, 2, 4, 5, 11, 20):
            assert in_spans(lambda run: [i * i for i in run], items, workers, spans) == [i * i for i in items]
    # Closed (the backend closed while a call ran, or the interpreter exiting): the caller does it all.
    assert in_spans(lambda run: [i + 1 for i in run], items, workers, 4) == [i + 1 for i in items]


def test_unreachable_mooncake_master_is_a_clear_error():
    with pytest.raises(Unavailable, match="master at 127.0.0.1:1 cannot be reached"):
        open_backend("mooncake", master="127.0.0.1:1", metadata_server="http://127.0.0.1:1/metadata", buffers=[],
                     connect_timeout_s=1)


def test_allocator_is_deterministic_and_never_hands_out_retiring_slots():
    a, b = PageAllocator(8), PageAllocator(8)
    handed_out = []
    for alloc in (a, b):
        first = alloc.allocate(3)
        alloc.retire(first[:2])
        handed_out.append(alloc.allocate(2))
        alloc.reclaim([first[0]])
    assert handed_out == [[3, 4], [3, 4]]  # slot 1 still retiring: never handed out
    assert a.allocate(1) == b.allocate(1) == [0]  # reclaimed, lowest first
    with pytest.raises(ResourceExhausted, match="4 pages asked, 3 of 8 free"):
        a.allocate(4)


def test_slow_read_keeps_its_slot_out_of_reuse_until_it_ends(tmp_path):
    """A read into slot 0 is slow; its owner gives the slot up meanwhile. The
    slot is not handed out again until the read has ended."""
    backend, tiers = write_pages(tmp_path, ["slow"])
    release = threading.Event()

    class Gate(StorageBackend):  # the slow storage: a real backend behind an event
        name = "gate"

        def exists_prefix(self, keys):
            return backend.exists_prefix(keys)

        def get_into(self, keys, pages):
            release.wait(30)
            return backend.get_into(keys, pages)

        def put_from(self, keys, pages):
            return backend.put_from(keys, pages)

    tiers.storage = FaultyBackend(Gate(), StorageFaults(delay_ms=5, seed=1))
    transfers = Transfers(tiers, threads=1)
    allocator = PageAllocator(1)
    slot = allocator.allocate(1)
    pending = transfers.submit((STORAGE, HOST), ["slow"], slot)
    allocator.retire(slot)  # e.g. the prefetch was revoked
    assert transfers.in_flight.busy(slot)
    with pytest.raises(ResourceExhausted):
        allocator.allocate(1)
    release.set()
    assert pending.result().success
    assert transfers.in_flight.wait_idle(slot, timeout_s=5)
    allocator.reclaim(slot)
    assert allocator.allocate(1) == slot
    transfers.close()


def test_a_pool_of_the_wrong_size_unsealed_or_read_only_is_refused(tmp_path):
    g = GEOMETRIES["mha"]
    small = DevicePool.create_sealed(g, pages=2)
    with pytest.raises(InvalidArgument, match="need .* bytes, but the pool holds"):
        DevicePool.from_fd(os.dup(small.fd), g, pages=4)
    path = tmp_path / "pool"
    path.write_bytes(b"\0" * g.page_bytes * 4)  # a plain file: it could shrink under the daemon (SIGBUS)
    with pytest.raises(FailedPrecondition, match="shmem memfd|sealed against shrinking"):
        DevicePool.from_fd(os.open(path, os.O_RDWR), g, pages=4)
    pool = DevicePool.create_sealed(g, pages=4)
    with pytest.raises(InvalidArgument, match="reading and writing"):
        DevicePool.from_fd(os.open(f"/proc/self/fd/{pool.fd}", os.O_RDONLY), g, pages=4)
    with pytest.raises(PermissionError):  # sealed: nobody can shrink it, its creator included
        os.ftruncate(pool.fd, 0)
    mapped = DevicePool.from_fd(os.dup(pool.fd), g, pages=4)
    pool.page_view(1).fill_(3)
    assert torch.equal(mapped.page_view(1), pool.page_view(1))  # the same memory


# SGLang's host buffer shapes (pool_host/mha.py and mla.py, init_kv_buffer),
# for `pages` pages: the component leads, and MLA has none.
def sglang_host_shape(g: KVGeometry, layout: str, pages: int) -> tuple[int, ...]:
    size = pages * g.page_size
    if g.kv_kind == "mla":
        return {"layer_first": (g.layers, size, 1, g.head_dim), "page_first": (size, g.layers, 1, g.head_dim),
                "page_first_direct": (pages, g.layers, g.page_size, 1, g.head_dim)}[layout]
    return {"layer_first": (2, g.layers, size, g.heads, g.head_dim),
            "page_first": (2, size, g.layers, g.heads, g.head_dim),
            "page_first_direct": (2, pages, g.layers, g.page_size, g.heads, g.head_dim)}[layout]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv", ["mha", "mla"])
def test_host_pages_sit_where_sglang_puts_them_and_are_stored_in_its_order(tmp_path, layout, kv):
    geometry = GEOMETRIES[kv]
    g = geometry
    device = DevicePool.create_sealed(geometry, pages=4)
    fill_random(device, seed=7)
    host = HostPool(geometry, pages=4, layout=layout)
    assert host.tensor.numel() == math.prod(sglang_host_shape(geometry, layout, 4))
    sglang = host.tensor.view(sglang_host_shape(geometry, layout, 4))
    store = open_backend("file", root=str(tmp_path / "store"), geometry_fingerprint=g.fingerprint())
    tiers = Tiers(host, device, store)
    transfers = Transfers(tiers, threads=1)
    try:
        assert transfers.submit((DEVICE, HOST), [2], [3]).result(10).success  # device page 2 -> host slot 3
        assert transfers.submit((HOST, STORAGE), [3], ["stored-page"]).result(10).success
    finally:
        transfers.close()
    page = device.tensor[:, :, 2 * g.page_size : 3 * g.page_size]  # [L, C, ps, H, D]
    tokens = slice(3 * g.page_size, 4 * g.page_size)
    views = {  # where SGLang reads component c of host slot 3, as [layers, page_size, heads, head_dim]
        "layer_first": lambda c: sglang[c, :, tokens] if kv == "mha" else sglang[:, tokens],
        "page_first": lambda c: (sglang[c, tokens] if kv == "mha" else sglang[tokens]).transpose(0, 1),
        "page_first_direct": lambda c: sglang[c, 3] if kv == "mha" else sglang[3],
    }
    for c in range(g.components):
        expected = page[:, c]  # [L, ps, H, D]
        found = views[layout](c).reshape(expected.shape)
        assert torch.equal(found.view(torch.uint8), expected.view(torch.uint8)), (layout, kv, c)
    (stored,) = [p for p in (tmp_path / "store").rglob("stored-page") if p.is_file()]
    payload = stored.read_bytes()[HEADER.size:]
    # [components, layers, page_size, heads, head_dim], SGLang's page_first_direct order.
    assert payload == page.transpose(0, 1).contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_a_rescan_that_fails_is_counted_and_eviction_goes_on_with_what_the_index_knows(tmp_path, monkeypatch):
    """Eviction runs on its own thread: a failure there is logged and
    counted, never lost, and the pages this daemon wrote are still evicted."""
    backend, tiers, page_file = bounded_to_three_pages(tmp_path)

    def unreadable(*args):
        raise PermissionError("the root cannot be listed")

    monkeypatch.setattr(backend, "_listing", unreadable)
    backend.put_from([f"p{i}" for i in range(4)], tiers.host_buffers(range(4)))
    backend.wait_evictions()
    assert backend.counters()["storage_eviction_errors"] >= 1
    assert backend.exists_prefix(["p0"]) == 0 and backend.exists_prefix(["p1", "p2", "p3"]) == 3
    assert backend.used_bytes == 3 * page_file
