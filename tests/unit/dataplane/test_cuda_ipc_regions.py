"""Where the layers of a pool shared by CUDA IPC land, checked on the CPU
with the opening of a handle faked as torch does it: the caching
allocator's block, named by its handle, plus the storage's offset in it.
SGLang's per-layer buffers are separate storages that often share one
block (one handle): each must open at its own offset, a storage named
twice must open once, regions of different storages are compared where
they lie in the block, and the handle's fields reach the daemon as the
types torch takes."""

import pytest
import torch

from cpcache.client.messages import attach_request
from cpcache.daemon.wire import CudaPool, attach_from_wire
from cpcache.dataplane.pools import DevicePool
from cpcache.dataplane.regions import contiguous
from cpcache.errors import FailedPrecondition
from cpcache.geometry import KVGeometry, Region

pytestmark = pytest.mark.timeout(30)

GEOMETRY = KVGeometry(layers=2, kv_kind="mha", heads=2, head_dim=8, dtype="bfloat16", page_size=4)
PAGES = 2
LAYER_BYTES = GEOMETRY.page_bytes * PAGES // GEOMETRY.layers
STRIDES = contiguous(GEOMETRY, PAGES)[0].strides


class FakeIpc:
    """Blocks of host bytes by handle; `open` is `_new_shared_cuda`."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytearray] = {}
        self.opened: list[tuple[bytes, int, int]] = []
        self.devices: list[int] = []

    def block(self, handle: bytes, nbytes: int) -> bytearray:
        self.blocks[handle] = bytearray(nbytes)
        return self.blocks[handle]

    def open(self, device, handle, size, offset, ref_counter, ref_offset, event, event_sync):
        self.opened.append((handle, offset, size))
        self.devices.append(device)
        view = memoryview(self.blocks[handle])[offset : offset + size]
        return torch.frombuffer(view, dtype=torch.uint8).untyped_storage()

    @staticmethod
    def fields(handle: bytes, offset: int, size: int) -> dict:
        return dict(device=0, handle=handle, storage_size=size, storage_offset=offset, ref_counter_handle=b"rc",
                    ref_counter_offset=0, event_handle=b"", event_sync_required=False)


@pytest.fixture
def ipc(monkeypatch):
    fake = FakeIpc()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", staticmethod(fake.open), raising=False)
    return fake


def written_at(block: bytearray, offset: int) -> int:
    return int(torch.frombuffer(block, dtype=torch.int16)[offset // 2])


def test_layers_in_one_block_open_at_their_own_offsets(ipc):
    block = ipc.block(b"A", 4 * LAYER_BYTES)
    starts = [LAYER_BYTES, 3 * LAYER_BYTES]  # where the allocator put each layer's storage
    regions = [Region(0, STRIDES, FakeIpc.fields(b"A", s, LAYER_BYTES)) for s in starts]
    pool = DevicePool.from_cuda_ipc(None, GEOMETRY, PAGES, regions)
    assert sorted(ipc.opened) == [(b"A", s, LAYER_BYTES) for s in starts]
    for layer, start in enumerate(starts):
        pool.layers[layer].view(torch.int16).fill_(layer + 1)
        assert written_at(block, start) == layer + 1 and written_at(block, start + LAYER_BYTES - 2) == layer + 1
    assert written_at(block, 0) == 0 and written_at(block, 2 * LAYER_BYTES) == 0


def test_a_handle_opens_on_the_daemons_index_of_the_schedulers_gpu(ipc, monkeypatch):
    """A scheduler and a daemon with different CUDA_VISIBLE_DEVICES: the
    scheduler's cuda:0 is the daemon's cuda:1; a GPU the daemon lacks is
    refused before anything is opened."""
    ipc.block(b"D", 2 * LAYER_BYTES)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: type("P", (), {"uuid": ["gpu-a", "gpu-b"][index]})())
    regions = [Region(r.offset, r.strides, dict(FakeIpc.fields(b"D", 0, 2 * LAYER_BYTES), device_uuid="gpu-c"))
               for r in contiguous(GEOMETRY, PAGES)]
    with pytest.raises(FailedPrecondition, match="GPU gpu-c.*CUDA_VISIBLE_DEVICES"):
        DevicePool.from_cuda_ipc(None, GEOMETRY, PAGES, regions)
    assert ipc.opened == []
    elsewhere = [Region(r.offset, r.strides, dict(r.cuda_ipc, device_uuid="gpu-b")) for r in regions]
    DevicePool.from_cuda_ipc(None, GEOMETRY, PAGES, elsewhere)
    assert ipc.opened == [(b"D", 0, 2 * LAYER_BYTES)] and ipc.devices == [1]


def test_a_storage_named_by_every_region_opens_once(ipc):
    ipc.block(b"B", 3 * LAYER_BYTES)
    handle = FakeIpc.fields(b"B", LAYER_BYTES, 2 * LAYER_BYTES)
    regions = [Region(r.offset, r.strides, handle) for r in contiguous(GEOMETRY, PAGES)]
    DevicePool.from_cuda_ipc(None, GEOMETRY, PAGES, regions)
    assert ipc.opened == [(b"B", LAYER_BYTES, 2 * LAYER_BYTES)]


def test_regions_of_two_storages_over_the_same_bytes_of_a_block_are_refused(ipc):
    ipc.block(b"C", 4 * LAYER_BYTES)
    first = Region(LAYER_BYTES, STRIDES, FakeIpc.fields(b"C", 0, 2 * LAYER_BYTES))  # block bytes [L, 2L)
    second = Region(0, STRIDES, FakeIpc.fields(b"C", LAYER_BYTES, 2 * LAYER_BYTES))  # the same bytes
    with pytest.raises(FailedPrecondition, match="overlap"):
        DevicePool.from_cuda_ipc(None, GEOMETRY, PAGES, [first, second])


def test_the_fields_cross_the_wire_with_the_types_torch_checks():
    """`_new_shared_cuda` refuses anything but ints, bytes and a bool."""
    fields = dict(device=0, handle=b"\x01\x00" + bytes(range(64)), storage_size=LAYER_BYTES, storage_offset=2 << 20,
                  ref_counter_handle=b"/torch_1_2", ref_counter_offset=7, event_handle=bytes(64),
                  event_sync_required=True, device_uuid="5b1f0e3a-8c1d-4d55-9a0e-0f6c2b7d9e11")
    regions = [Region(0, STRIDES, fields)] * GEOMETRY.layers
    request = attach_request("m", GEOMETRY, PAGES, regions=regions)
    ask = attach_from_wire(type(request).FromString(request.SerializeToString()))
    assert ask.pool == CudaPool(None)  # every region names its own storage
    for region in ask.regions:
        assert region.cuda_ipc == fields
        assert [type(region.cuda_ipc[k]) for k in fields] == [type(v) for v in fields.values()]
