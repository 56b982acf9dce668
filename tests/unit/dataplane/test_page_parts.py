"""Pages with a part beside their KV (DeepSeek V3.2's indexer keys and
scales): declared in the geometry, one region per layer and part, moved
whole between every tier in every host layout (run by run and by gather /
scatter), a layer published only once every part of it landed, stored as
one frame whose bytes are the same whatever the host layout, and copied
whole by a scheduler finishing a load its daemon died in."""

import os

import pytest
import torch

from cpcache.client.daemon_process import DaemonProcess
from cpcache.dataplane import regions
from cpcache.dataplane.movers import DEVICE, HOST, STORAGE, Tiers, Transfers
from cpcache.dataplane.pools import DevicePool, HostPool
from cpcache.dataplane.storage import open_backend
from cpcache.dataplane.storage.framing import HEADER
from cpcache.errors import FailedPrecondition, InvalidArgument
from cpcache.geometry import KVGeometry, PagePart, Region
from cpcache.hashing import hash62
from cpcache.host_layout import LAYOUTS
from cpcache.integrations.sglang.orphan_loads import OrphanLoads
from cpcache.load_signals import LoadSignals
from tests.unit.dataplane.test_data_plane import fill_random, page_of, zero

pytestmark = pytest.mark.timeout(60)

PAGE = 4
INDEXER = PagePart("indexer", rows_per_page=1, width=PAGE * 132, dtype="uint8")
DSA = KVGeometry(layers=3, kv_kind="mla", heads=1, head_dim=20, dtype="bfloat16", page_size=PAGE, beside=(INDEXER,))
# An MHA page with a float32 part of two rows a page (the next pool's state, say): K, V and the part, three runs.
MHA_AND_STATE = KVGeometry(layers=2, kv_kind="mha", heads=2, head_dim=6, dtype="bfloat16", page_size=3,
                           beside=(PagePart("state", rows_per_page=2, width=5, dtype="float32"),))
PAGES = 12


def test_a_part_is_a_geometry_of_its_own_and_counts_in_the_page():
    kv, indexer = DSA.parts
    assert DSA.part_names == ("kv", "indexer")
    assert kv == KVGeometry(layers=3, kv_kind="mla", heads=1, head_dim=20, dtype="bfloat16", page_size=PAGE)
    assert (indexer.page_size, indexer.head_dim, indexer.dtype) == (1, PAGE * 132, "uint8")
    assert DSA.page_bytes == kv.page_bytes + 3 * PAGE * 132
    assert DSA.fingerprint() != kv.fingerprint()  # another page: never read as the KV alone
    # A page of KV alone keeps the fingerprint it had before parts existed (stored pages stay readable).
    assert kv.fingerprint() == hash62(repr((3, "mla", 1, 20, "bfloat16", PAGE)).encode())


@pytest.mark.parametrize("parts, words", [
    ([("indexer", 1, 8, "uint8"), ("indexer", 1, 8, "uint8")], "distinct"),
    ([("kv", 1, 8, "uint8")], "not 'kv'"),
    ([("", 1, 8, "uint8")], "1 to 32 of a-z"),
    ([("index\nforged log line", 1, 8, "uint8")], "1 to 32 of a-z"),
    ([(f"p{i}", 1, 8, "uint8") for i in range(9)], "9 parts beside the KV; at most 8"),
    ([("x", 0, 8, "uint8")], "part 'x': rows_per_page must be a positive integer"),
    ([("x", 1, 8, "int4")], "part 'x': dtype must be one of"),
    ([("x", 1, 1 << 40, "uint8")], "part 'x': a page of"),
])
def test_bad_parts_are_refused_with_the_reason(parts, words):
    with pytest.raises(InvalidArgument, match=words):
        KVGeometry(layers=3, kv_kind="mla", heads=1, head_dim=20, dtype="bfloat16", page_size=PAGE,
                   beside=tuple(PagePart(*part) for part in parts))


def test_a_contiguous_pool_starts_each_part_aligned_and_a_pool_missing_a_part_is_refused():
    kv, state = regions.part_blocks(MHA_AND_STATE, PAGES)
    assert kv == (0, MHA_AND_STATE.parts[0].page_bytes * PAGES)
    assert state[0] % 64 == 0 and state[0] >= kv[1] and regions.pool_bytes(MHA_AND_STATE, PAGES) == sum(state)
    device = DevicePool.create_sealed(MHA_AND_STATE, PAGES)
    assert [p.geometry for p in device.parts] == list(MHA_AND_STATE.parts)
    with pytest.raises(InvalidArgument, match="0 pools beside the KV for the geometry's 1 parts"):
        DevicePool.of_tensor(MHA_AND_STATE, torch.zeros(MHA_AND_STATE.pool_shape(PAGES)))


def test_regions_are_one_per_layer_and_part_and_may_not_overlap_across_parts():
    good = regions.contiguous(DSA, PAGES)
    assert len(good) == 2 * DSA.layers
    regions.check(DSA, PAGES, good, [regions.pool_bytes(DSA, PAGES)] * len(good))
    with pytest.raises(InvalidArgument, match="for each of its 2 parts"):
        regions.check(DSA, PAGES, good[:3], [regions.pool_bytes(DSA, PAGES)] * 3)
    overlapping = [*good[:4], Region(good[0].offset, good[4].strides), good[5]]  # indexer layer 1 on KV layer 0
    with pytest.raises(FailedPrecondition, match=r"region 0 \(kv layer 0\) and region 4 \(indexer layer 1\) overlap"):
        regions.check(DSA, PAGES, overlapping, [regions.pool_bytes(DSA, PAGES)] * len(good))


@pytest.mark.parametrize("geometry", [DSA, MHA_AND_STATE], ids=["dsa", "mha+state"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_part_moves_between_every_tier_scattered_or_not(tmp_path, layout, copy_path, geometry):
    device = DevicePool.create_sealed(geometry, PAGES)
    fill_random(device, seed=11)
    original = [page_of(device, p) for p in range(PAGES)]
    host = HostPool(geometry, pages=8, layout=layout)
    storage = open_backend("file", root=str(tmp_path / "s"), geometry_fingerprint=geometry.fingerprint())
    transfers = Transfers(Tiers(host, device, storage), threads=2)
    try:
        device_pages, slots = [11, 0, 5, 6, 2, 9], [7, 1, 0, 3, 6, 2]
        keys = [f"p{p}" for p in device_pages]
        assert transfers.submit((DEVICE, HOST), device_pages, slots).result().success
        assert transfers.submit((HOST, STORAGE), slots, keys).result().success
        zero(host)
        back = [4, 5, 0, 1, 2, 3]
        assert transfers.submit((STORAGE, HOST), keys, back).result().pages_done == len(keys)
        zero(device)
        targets = [1, 3, 4, 7, 8, 10]
        assert transfers.submit((HOST, DEVICE), back, targets).result().success
        for source, target in zip(device_pages, targets):
            for name, now, before in zip(geometry.part_names, page_of(device, target), original[source]):
                assert torch.equal(now, before), f"page {source} -> {target}: its {name} differs"
        assert all(part.count_nonzero() == 0 for p in set(range(PAGES)) - set(targets) for part in page_of(device, p))
    finally:
        transfers.close()


def test_a_stored_page_is_the_same_bytes_whatever_the_host_layout(tmp_path):
    device = DevicePool.create_sealed(DSA, PAGES)
    fill_random(device, seed=5)
    stored = []
    for layout in LAYOUTS:
        storage = open_backend("file", root=str(tmp_path / layout), geometry_fingerprint=DSA.fingerprint())
        transfers = Transfers(Tiers(HostPool(DSA, pages=4, layout=layout), device, storage), threads=1)
        try:
            assert transfers.submit((DEVICE, HOST), [3], [2]).result().success
            assert transfers.submit((HOST, STORAGE), [2], ["page"]).result().success
        finally:
            transfers.close()
        with open(storage.path("page"), "rb") as f:
            stored.append(f.read()[HEADER.size:])
    assert stored[0] == stored[1] == stored[2]
    kv, indexer = (part.numpy().tobytes() for part in page_of(device, 3))
    # [components, layers, rows, heads, head_dim] of the KV, then of the indexer
    layers_first = page_of(device, 3)[0].view(DSA.layers, 1, -1).transpose(0, 1).contiguous().numpy().tobytes()
    assert stored[0] == layers_first + indexer and len(kv) == len(layers_first)


def test_a_layer_is_published_once_every_part_of_it_landed(copy_path):
    device = DevicePool.create_sealed(DSA, PAGES)
    fill_random(device, seed=7)
    board = LoadSignals.create(2)
    fd = os.dup(board.fd)
    device.signals = LoadSignals.mapped(fd, os.fstat(fd).st_size, 2)
    host = HostPool(DSA, pages=8, layout="page_first")
    transfers = Transfers(Tiers(host, device), threads=2)
    targets = {1: 6, 2: 7}

    def layer_landed(layer: int) -> list[bool]:
        """Per part, whether layer `layer` of every target page holds its source's bytes now."""
        return [all(torch.equal(part.layer_pages(layer, t).view(torch.uint8), originals[s][i][layer])
                    for s, t in targets.items()) for i, part in enumerate(device.parts)]

    seen: list[tuple[int, list[bool]]] = []
    publish = device.signals.publish

    def watched(slot: int, op: int, layers: int) -> None:  # what the board says the forward may read
        seen.append((layers, layer_landed(layers - 1)))
        publish(slot, op, layers)

    device.signals.publish = watched  # type: ignore[method-assign]
    try:
        assert transfers.submit((DEVICE, HOST), list(targets), [4, 5]).result().success
        originals = {s: [[part.layer_pages(layer, s).view(torch.uint8).clone() for layer in range(DSA.layers)]
                         for part in device.parts] for s in targets}
        for part in device.parts:
            part.tensor[:, :, 6 * part.geometry.page_size :].zero_()  # the targets (and after) start empty
        slot = board.claim(op=9)
        assert transfers.submit((HOST, DEVICE), [4, 5], list(targets.values()), signal=(slot, 9)).result().success
        assert board.progress(slot, 9) == DSA.layers
    finally:
        transfers.close()
    # Every publication of layer l came after both parts of layer l had landed.
    assert seen == [(layer + 1, [True, True]) for layer in range(DSA.layers)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_scheduler_finishing_an_orphaned_load_copies_every_part_of_the_layers_left(layout):
    """`OrphanLoads` (the scheduler's side of a daemon dead mid-load) reads
    the daemon's host pool memfd read-only and copies every part."""
    host = HostPool(DSA, pages=4, layout=layout)
    fill_random(host, seed=3)
    device = DevicePool.create_sealed(DSA, PAGES)
    buffers = [(layer[0],) for part in device.parts for layer in part.layers]  # per region, [rows, heads, dim]
    orphans = OrphanLoads(os.dup(host.fd), DaemonProcess(-1), DSA, host.pages, layout, buffers)
    try:
        orphans.copy([2, 0], [5, 9], first_layer=1)
    finally:
        orphans.close()
    for part_device, part_host in zip(device.parts, host.parts):
        for layer in range(DSA.layers):
            for slot, page in ((2, 5), (0, 9)):
                landed = part_device.layer_pages(layer, page)[0, 0].view(torch.uint8)  # bits: NaNs compare too
                if layer == 0:  # the daemon had landed layer 0 itself: not copied again
                    assert landed.count_nonzero() == 0
                else:
                    assert torch.equal(landed, part_host.paged_layer(layer)[slot, 0].view(torch.uint8))
