"""A device pool attached as one region per layer, where its creator put
each layer (SGLang's per-layer buffers): the checks that refuse regions the
daemon must not map, and movers that land bit for bit in those buffers and
nowhere else, for every host layout, MHA and MLA, run by run and by
gather / scatter."""

import fcntl
import mmap
import os

import numpy as np
import pytest
import torch

from cpcache.dataplane import regions
from cpcache.dataplane.movers import DEVICE, HOST, Tiers, Transfers
from cpcache.dataplane.pools import DevicePool, HostPool
from cpcache.errors import FailedPrecondition, InvalidArgument
from cpcache.geometry import KVGeometry, Region
from cpcache.host_layout import LAYOUTS

pytestmark = pytest.mark.timeout(60)

MHA = KVGeometry(layers=3, kv_kind="mha", heads=2, head_dim=8, dtype="bfloat16", page_size=4)
MLA = KVGeometry(layers=3, kv_kind="mla", heads=1, head_dim=24, dtype="float16", page_size=8)
PAGES = 8


def sealed_memfd(nbytes: int) -> int:
    fd = os.memfd_create("test-regions", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


class Creator:
    """The inference process's side: a memfd whose layers lie as SGLang lays
    them out (MHA: a [2, padded rows, heads, head_dim] block per layer, K and
    V its halves, `pad` unused rows after each), the tensors it computes on,
    and the regions that describe them."""

    def __init__(self, geometry: KVGeometry, pad: int = 3, component_major: bool = False) -> None:
        g, rows = geometry, PAGES * geometry.page_size
        padded = rows + pad
        shape = ((g.components, g.layers) if component_major else (g.layers, g.components)) + (padded, g.heads,
                                                                                               g.head_dim)
        self.nbytes = int(np.prod(shape)) * g.element_bytes + 64  # and a tail nothing owns
        self.fd = sealed_memfd(self.nbytes)
        self.mapping = mmap.mmap(self.fd, self.nbytes)
        self.raw = torch.frombuffer(self.mapping, dtype=torch.uint8)
        whole = self.raw[: int(np.prod(shape)) * g.element_bytes].view(g.torch_dtype).view(shape)
        self.blocks = whole.transpose(0, 1) if component_major else whole  # [layers, components, padded, H, D]
        self.buffers = [[self.blocks[layer, c, :rows] for c in range(g.components)] for layer in range(g.layers)]
        base = self.raw.data_ptr()
        self.regions = []
        for layer in self.buffers:
            k = layer[0]
            component = (layer[1].data_ptr() - k.data_ptr()) // g.element_bytes if len(layer) > 1 else 0
            self.regions.append(Region(k.data_ptr() - base, (component, *k.stride())))

    def fill_random(self, seed: int) -> None:
        self.raw.copy_(torch.from_numpy(np.random.default_rng(seed).integers(0, 256, self.nbytes, dtype=np.uint8)))

    def attach(self) -> DevicePool:
        return DevicePool.from_fd(os.dup(self.fd), self.geometry_of(), PAGES, self.regions)

    def geometry_of(self) -> KVGeometry:
        return MHA if len(self.buffers[0]) == 2 else MLA

    def page_bytes(self, page: int) -> list[torch.Tensor]:
        s = self.geometry_of().page_size
        return [b[page * s:(page + 1) * s].clone().view(torch.uint8) for layer in self.buffers for b in layer]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("geometry", [MHA, MLA], ids=["mha", "mla"])
@pytest.mark.parametrize("component_major", [False, True], ids=["layer-major", "component-major"])
def test_per_layer_movers_are_bit_exact_and_touch_nothing_else(layout, geometry, component_major, copy_path):
    creator = Creator(geometry, component_major=component_major)
    creator.fill_random(seed=len(layout))
    device = creator.attach()
    pages, slots = [1, 2, 3, 6], [5, 0, 1, 7]
    originals = {p: creator.page_bytes(p) for p in pages}
    host = HostPool(geometry, pages=8, layout=layout)
    transfers = Transfers(Tiers(host, device), threads=2)
    try:
        assert transfers.submit((DEVICE, HOST), pages, slots).result().success
        s = geometry.page_size
        for p in pages:  # the creator zeroes what was copied out
            for layer in creator.buffers:
                for b in layer:
                    b[p * s:(p + 1) * s].zero_()
        before = creator.raw.clone()
        targets = [0, 4, 5, 7]
        assert transfers.submit((HOST, DEVICE), slots, targets).result().success
        for p, t in zip(pages, targets):
            got = creator.page_bytes(t)
            assert all(torch.equal(a, b) for a, b in zip(got, originals[p])), f"page {p} -> {t} differs"
        # Nothing outside the target pages' rows changed: not the padding, not the tail, not another page.
        s = geometry.page_size
        changed = (creator.raw != before).nonzero().flatten()
        allowed = torch.zeros(creator.nbytes, dtype=torch.bool)
        base = creator.raw.data_ptr()
        for t in targets:
            for layer in creator.buffers:
                for b in layer:
                    rows = b[t * s:(t + 1) * s]
                    start = rows.data_ptr() - base
                    allowed[start:start + rows.numel() * rows.element_size()] = True
        assert bool(allowed[changed].all()), "a mover wrote outside the target pages"
    finally:
        transfers.close()


def test_what_the_creator_writes_the_daemon_reads_in_place():
    creator = Creator(MHA)
    device = creator.attach()
    creator.buffers[2][1][5].fill_(1.5)  # layer 2, V, row 5
    assert torch.equal(device.layers[2][1, 5], creator.buffers[2][1][5])
    device.layers[0][0, 3].fill_(-2.0)  # and the other way
    assert bool((creator.buffers[0][0][3] == -2.0).all())


def test_a_contiguous_pool_is_regions_at_regular_offsets():
    pool = DevicePool.create_sealed(MHA, pages=PAGES)
    assert pool.tensor.shape == MHA.pool_shape(PAGES)
    again = DevicePool.from_fd(os.dup(pool.fd), MHA, PAGES, regions.contiguous(MHA, PAGES))
    pool.tensor[1, 1, 7].fill_(3.0)
    assert torch.equal(again.tensor, pool.tensor)


GOOD = regions.contiguous(MHA, PAGES)
LAYER_BYTES = GOOD[1].offset


@pytest.mark.parametrize("bad, error, words", [
    (GOOD[:2], InvalidArgument, "2 regions for 3 layers"),
    (GOOD + [GOOD[0]], InvalidArgument, "4 regions for 3 layers"),
    ([GOOD[0], GOOD[1], Region(GOOD[2].offset, (1, 2, 3))], InvalidArgument, "strides"),
    ([GOOD[0], GOOD[1], Region(GOOD[2].offset + 1, GOOD[2].strides)], InvalidArgument, "not a multiple"),
    ([GOOD[0], GOOD[1], Region(GOOD[2].offset + 2, GOOD[2].strides)], InvalidArgument, "past the"),
    ([GOOD[0], GOOD[1], Region(GOOD[2].offset, (0, 16, 8, 1))], InvalidArgument, "two elements"),
    ([GOOD[0], GOOD[1], Region(GOOD[2].offset, (512, 8, 8, 1))], InvalidArgument, "two elements"),
    ([GOOD[0], Region(GOOD[0].offset + 2, GOOD[0].strides), GOOD[2]], FailedPrecondition, "overlap"),
    ([GOOD[0], GOOD[1], GOOD[1]], FailedPrecondition, "region 1 and region 2 overlap"),
])
def test_regions_the_daemon_must_not_map_are_refused(bad, error, words):
    with pytest.raises(error, match=words):
        regions.check(MHA, PAGES, bad, [LAYER_BYTES * 3] * len(bad))


def test_a_memfd_whose_regions_are_refused_is_not_mapped():
    creator = Creator(MHA)
    beyond = [*creator.regions[:2], Region(creator.nbytes, creator.regions[2].strides)]
    with pytest.raises(InvalidArgument, match="region 2 ends"):
        DevicePool.from_fd(os.dup(creator.fd), MHA, PAGES, beyond)
    with pytest.raises(FailedPrecondition, match="overlap"):
        DevicePool.from_fd(os.dup(creator.fd), MHA, PAGES, [creator.regions[0]] * 3)
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, creator.nbytes)
    with pytest.raises(FailedPrecondition, match="sealed"):
        DevicePool.from_fd(unsealed, MHA, PAGES, creator.regions)


def test_regions_in_one_cuda_block_are_compared_where_they_lie():
    """Two storages of one allocator block (SGLang's small layers): the same
    offset in each is not an overlap; the same bytes of the block are."""
    one = regions.contiguous(MHA, PAGES)[:1] * 3
    size = LAYER_BYTES
    regions.check(MHA, PAGES, one, [size] * 3, memory_of=["block"] * 3, base_of=[0, size, 2 * size])
    with pytest.raises(FailedPrecondition, match="overlap"):
        regions.check(MHA, PAGES, one, [size] * 3, memory_of=["block"] * 3, base_of=[0, size, size])
    regions.check(MHA, PAGES, one, [size] * 3, memory_of=["a", "b", "c"], base_of=[0, 0, 0])
