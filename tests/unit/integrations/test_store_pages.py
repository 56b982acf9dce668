"""Pages an SGLang host pool writes into a domain's store directly
(`StorePages`, the decode offload's path) are the pages the domain's
daemons read: same keys, same frames, same stored order, whatever either
side's host layout; damaged objects read as misses; a replicated page is
one object; SGLang's host pools are read as the geometry they hold."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from cpcache.config import DaemonConfig
from cpcache.dataplane.storage import PageBuffer
from cpcache.dataplane.storage.file import FileBackend
from cpcache.errors import InvalidArgument
from cpcache.geometry import KVGeometry
from cpcache.host_layout import LAYOUTS, host_shape, stored_page
from cpcache.integrations.sglang.store_pages import StorePages, host_pool_geometry, page_slots
from cpcache.keys import ShardingSpec, chain, tenant_of

pytestmark = pytest.mark.timeout(60)

MHA = KVGeometry(layers=3, kv_kind="mha", heads=2, head_dim=4, dtype="float32", page_size=4)
MLA = KVGeometry(layers=3, kv_kind="mla", heads=1, head_dim=8, dtype="bfloat16", page_size=4)
HOST_PAGES = 6


def sglang_host(geometry: KVGeometry, layout: str, seed: int = 0) -> torch.Tensor:
    """An SGLang host pool's buffer (K/V outermost), full of distinct values."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(host_shape(geometry, HOST_PAGES, layout), generator=generator).to(geometry.torch_dtype)


def store(tmp_path, geometry: KVGeometry, layout: str, host: torch.Tensor, **sharding: object) -> StorePages:
    config = DaemonConfig.from_settings({"rank": 0, "storage": "file", "storage_root": str(tmp_path / "pages")})
    spec = ShardingSpec(tp_sharded_heads=geometry.kv_kind == "mha", tenant=tenant_of("m", geometry.fingerprint()),
                        **sharding)  # type: ignore[arg-type]
    return StorePages.open(config, geometry, spec, host, layout)


def hashes(n: int) -> list[str]:
    return chain(list(range(n * 4)), 4, None)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_put_from_any_host_layout_are_the_daemons_stored_pages(tmp_path, layout):
    host = sglang_host(MHA, layout)
    pages = store(tmp_path, MHA, layout, host)
    keys, slots = hashes(3), [4, 1, 2]
    assert pages.put(keys, slots) == [True, True, True]
    # What a daemon of the domain reads: its own backend, its own keys.
    daemon = FileBackend(str(tmp_path / "pages"), MHA.fingerprint(), page_bytes=MHA.page_bytes)
    spec = ShardingSpec(tenant=tenant_of("m", MHA.fingerprint()))
    staged = [torch.zeros((MHA.components, MHA.layers, MHA.page_size, MHA.heads, MHA.head_dim)) for _ in keys]
    buffers = [PageBuffer(t.data_ptr(), t.view(-1).view(torch.uint8).numpy()) for t in staged]
    assert daemon.get_into([spec.storage_key(k) for k in keys], buffers) == [True, True, True]
    for slot, page in zip(slots, staged):
        assert torch.equal(page, stored_page(host, MHA, layout, slot))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_read_back_into_another_layout_equal_the_written_ones(tmp_path, layout):
    written = sglang_host(MHA, "layer_first", seed=1)
    assert store(tmp_path, MHA, "layer_first", written).put(hashes(2), [0, 5]) == [True, True]
    into = torch.zeros(host_shape(MHA, HOST_PAGES, layout))
    reader = store(tmp_path, MHA, layout, into)
    assert reader.exists_prefix(hashes(3)) == 2
    assert reader.get(hashes(2), [3, 1]) == [True, True]
    assert torch.equal(stored_page(written, MHA, "layer_first", 0), stored_page(into, MHA, layout, 3))
    assert torch.equal(stored_page(written, MHA, "layer_first", 5), stored_page(into, MHA, layout, 1))


def test_a_damaged_object_is_a_miss_and_nothing_after_it_is_read(tmp_path):
    host = sglang_host(MHA, "page_first")
    pages = store(tmp_path, MHA, "page_first", host)
    keys = hashes(3)
    assert pages.put(keys, [0, 1, 2]) == [True, True, True]
    damaged = pages.backend.path(pages.sharding.storage_key(keys[1]))  # type: ignore[attr-defined]
    with open(damaged, "r+b") as fh:
        fh.seek(os.path.getsize(damaged) - 1)
        last = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([last[0] ^ 0xFF]))
    into = torch.zeros_like(host)
    assert store(tmp_path, MHA, "page_first", into).get(keys, [3, 4, 5]) == [True, False, False]
    assert torch.count_nonzero(into[:, 4 * 4 :]) == 0  # slots 4 and 5: nothing landed


def test_a_replicated_page_is_one_object_written_whole_by_the_rank_sglang_chose(tmp_path):
    # MLA over attention TP 2: SGLang backs a replicated page up from TP rank
    # 0 only (its storage config's is_storage_writer); every page it hands
    # over is written, and the key has no rank in it.
    keys = hashes(8)
    pages = store(tmp_path, MLA, "page_first_direct", sglang_host(MLA, "page_first_direct"), tp_rank=0, tp_size=2)
    assert pages.put(keys, list(range(6)) + [0, 1]) == [True] * 8
    stored = [name for _, _, names in os.walk(tmp_path / "pages") for name in names]
    assert len(stored) == len(keys) and all(name.count("_") == 0 for name in stored), stored
    other_rank = store(tmp_path, MLA, "page_first_direct", torch.zeros(host_shape(MLA, HOST_PAGES, "page_first_direct"),
                                                                       dtype=torch.bfloat16), tp_rank=1, tp_size=2)
    assert other_rank.exists_prefix(keys) == 8


def test_sglang_host_pools_give_their_geometry_and_page_slots():
    mha = SimpleNamespace(layer_num=3, target_layer_num=3, dtype=torch.float32, head_num=2, head_dim=4, v_head_dim=4,
                          page_size=4, kv_buffer=torch.zeros(host_shape(MHA, HOST_PAGES, "layer_first")))
    assert host_pool_geometry(mha)[0] == MHA
    mla = SimpleNamespace(layer_num=3, dtype=torch.bfloat16, kv_lora_rank=6, kv_cache_dim=8, page_size=4,
                          kv_buffer=torch.zeros((3, HOST_PAGES * 4, 1, 8)))
    geometry, buffer = host_pool_geometry(mla)
    assert geometry == MLA and tuple(buffer.shape) == host_shape(MLA, HOST_PAGES, "layer_first")
    assert page_slots(torch.arange(8, 16).repeat_interleave(1), 2, 4) == [2, 3]
    with pytest.raises(InvalidArgument, match="draft-model layers"):
        host_pool_geometry(SimpleNamespace(**{**vars(mha), "layer_num": 4}))
    with pytest.raises(InvalidArgument, match="scale buffers"):
        host_pool_geometry(SimpleNamespace(**vars(mha), _buffer_infos=(SimpleNamespace(scales=object()),)))


def test_a_host_pool_of_another_geometry_is_refused(tmp_path):
    with pytest.raises(InvalidArgument, match="is not the layer_first layout"):
        store(tmp_path, MHA, "layer_first", torch.zeros(host_shape(MLA, HOST_PAGES, "layer_first")))
