"""Scattered pages copied by one gather / scatter per layer: which jobs go
that way, and that they land exactly where run-by-run copies land, bit for
bit, in every host layout and dtype, over per-layer regions at offsets and
strides no wider integer fits."""

import random

import pytest
import torch

from cpcache.dataplane import gather
from cpcache.dataplane.movers import DEVICE, HOST, Tiers, Transfers
from cpcache.dataplane.pools import DevicePool, HostPool
from cpcache.geometry import KVGeometry
from cpcache.host_layout import LAYOUTS

pytestmark = pytest.mark.timeout(60)

# 1-token pages of a 36-layer model (8 KV heads x 128, bf16): 144 KiB a page, 4 KiB a layer.
SMALL = KVGeometry(layers=36, kv_kind="mha", heads=8, head_dim=128, dtype="bfloat16", page_size=1)
# 512 KiB, 1 MiB and 4 MiB pages of 4 layers: 128 KiB, 256 KiB and 1 MiB a layer.
HALF = KVGeometry(layers=4, kv_kind="mha", heads=8, head_dim=128, dtype="bfloat16", page_size=32)
MEDIUM = KVGeometry(layers=4, kv_kind="mha", heads=8, head_dim=128, dtype="bfloat16", page_size=64)
LARGE = KVGeometry(layers=4, kv_kind="mha", heads=8, head_dim=128, dtype="bfloat16", page_size=256)


@pytest.mark.parametrize("geometry, pages, runs, expected", [
    (SMALL, 455, 453, True),  # scattered small pages: a gather per layer
    (SMALL, 455, 1, False),  # consecutive: one copy per layer already
    (SMALL, 8, gather.MANY_RUNS, False),  # a few runs
    (SMALL, 8, gather.MANY_RUNS + 1, True),
    (LARGE, 16, 14, False),  # long runs: their copies cost less than a pass more
    (LARGE, 16, 8, False),
    (MEDIUM, 64, 64, False),  # 256 KiB a layer
    (HALF, 128, 128, True),  # 128 KiB a layer
])
def test_scattered_short_runs_are_gathered_and_few_or_long_ones_are_not(geometry, pages, runs, expected):
    assert gather.gathers(geometry, pages, runs, list(range(pages))) is expected


def test_a_repeated_destination_is_copied_run_by_run():
    assert not gather.gathers(SMALL, 8, 8, [0, 1, 2, 3, 4, 5, 6, 0])


ODD = KVGeometry(layers=3, kv_kind="mha", heads=3, head_dim=5, dtype="float16", page_size=2)
FP8 = KVGeometry(layers=2, kv_kind="mla", heads=1, head_dim=12, dtype="float8_e4m3fn", page_size=4)
F32 = KVGeometry(layers=2, kv_kind="mha", heads=2, head_dim=4, dtype="float32", page_size=3)
PAGES = 24


def strided_layers(geometry: KVGeometry, pad: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per-layer [components, rows, heads, head_dim] views of one memory,
    `pad` unused elements before each layer and after each row and each
    component, random bits everywhere."""
    g, rows = geometry, PAGES * geometry.page_size
    row = g.heads * g.head_dim + pad
    component = rows * row + pad
    layer_elements = g.components * component + pad
    memory = torch.empty(g.layers * layer_elements + pad, dtype=g.torch_dtype)
    memory.view(torch.uint8).random_(0, 256)
    layers = [memory.as_strided((g.components, rows, g.heads, g.head_dim), (component, row, g.head_dim, 1),
                                pad + layer * layer_elements) for layer in range(g.layers)]
    return memory, layers


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("geometry, pad", [(ODD, 1), (FP8, 3), (F32, 1), (SMALL, 4)],
                         ids=["odd-f16", "fp8", "f32", "bf16"])
@pytest.mark.parametrize("consecutive", ["neither", "host", "device"])
def test_gathered_pages_land_where_run_by_run_copies_land(layout, geometry, pad, consecutive, monkeypatch):
    rng = random.Random(7)

    def pages(first: int, side: str) -> list[int]:
        return list(range(first, first + 12)) if consecutive == side else rng.sample(range(PAGES), 12)

    stores = pages(5, "device"), pages(3, "host")  # device pages -> host slots
    loads = pages(9, "host"), pages(8, "device")  # host slots -> device pages
    finals = {}
    for path, many in (("runs", 1 << 30), ("gather", 0)):
        monkeypatch.setattr(gather, "MANY_RUNS", many)
        torch.manual_seed(1)
        memory, layers = strided_layers(geometry, pad)
        host = HostPool(geometry, pages=PAGES, layout=layout)
        host.tensor.view(torch.uint8).random_(0, 256)
        transfers = Transfers(Tiers(host, DevicePool(geometry, layers)), threads=1)
        try:
            assert transfers.submit((DEVICE, HOST), *stores).result().success
            stored = bits(host.tensor).clone()
            assert transfers.submit((HOST, DEVICE), *loads).result().success
        finally:
            transfers.close()
        finals[path] = (stored, bits(memory).clone())
    assert torch.equal(finals["runs"][0], finals["gather"][0]), "device -> host differs"
    assert torch.equal(finals["runs"][1], finals["gather"][1]), "host -> device differs"


def test_integers_as_wide_as_both_views_allow():
    _, layers = strided_layers(SMALL, pad=4)
    host = HostPool(SMALL, pages=PAGES, layout="page_first")
    device = DevicePool(SMALL, layers)
    on_device, on_host = gather._as_words(device.paged_layer(1), host.paged_layer(1))
    assert on_device.dtype == on_host.dtype == torch.int64
    _, odd = strided_layers(SMALL, pad=1)  # one bf16 off: only 2-byte integers fit
    on_device, on_host = gather._as_words(DevicePool(SMALL, odd).paged_layer(1), host.paged_layer(1))
    assert on_device.dtype == on_host.dtype == torch.int16
