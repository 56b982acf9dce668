"""The SGLang backend's side of in-place sharing, without SGLang: a pool
laid out as the plugin's shared-memory allocation lays SGLang's out is
described region by region (nothing moved), the daemon's mapping of those
regions is the pool's own memory, and buffers that are not the model
runner's are refused with an error that names the layer."""

import os
from types import SimpleNamespace

import pytest
import torch

from cpcache.dataplane.pools import DevicePool
from cpcache.integrations.sglang.pool import PoolNotShareable, check_in_place, share_device_pool
from cpcache.integrations.sglang.shared_memory import _ATTRIBUTE, SharedMemory

pytestmark = pytest.mark.timeout(60)

LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 8, 4
SIZE = 28  # tokens; rows = size + page = 32, a whole number of pages


def sglang_like_mha(shared: bool = True) -> SimpleNamespace:
    """What SGLang's MHATokenToKVPool holds once the plugin allocated it."""
    rows = SIZE + PAGE
    pool = SimpleNamespace(layer_num=LAYERS, head_num=HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM,
                           store_dtype=torch.bfloat16, kv_cache_layout="nhd", size=SIZE, page_size=PAGE)
    shape = (LAYERS, 2, rows, HEADS, HEAD_DIM)
    if shared:
        memory = SharedMemory.create(torch.Size(shape).numel() * 2)
        setattr(pool, _ATTRIBUTE, memory)
        blocks = memory.bytes().view(torch.bfloat16).view(shape)
    else:
        blocks = torch.zeros(shape, dtype=torch.bfloat16)
    pool.k_buffer = [blocks[layer, 0] for layer in range(LAYERS)]
    pool.v_buffer = [blocks[layer, 1] for layer in range(LAYERS)]
    pool.k_data_ptrs = torch.tensor([b.data_ptr() for b in pool.k_buffer], dtype=torch.uint64)
    pool.v_data_ptrs = torch.tensor([b.data_ptr() for b in pool.v_buffer], dtype=torch.uint64)
    return pool


def test_the_regions_describe_the_buffers_where_they_are_and_the_daemon_maps_them():
    kv_pool = sglang_like_mha()
    before = [(k.data_ptr(), v.data_ptr()) for k, v in zip(kv_pool.k_buffer, kv_pool.v_buffer)]
    shared = share_device_pool(kv_pool, PAGE)
    assert shared.device_pages == (SIZE + PAGE) // PAGE and len(shared.regions) == LAYERS
    assert shared.addresses() == before
    check_in_place(shared, kv_pool)
    daemon = DevicePool.from_fd(os.dup(shared.fd), shared.geometry, shared.device_pages, shared.regions)
    daemon.layers[1][1, 5].fill_(7.0)  # what the daemon's movers write, V of layer 1, row 5
    assert bool((kv_pool.v_buffer[1][5] == 7.0).all())
    kv_pool.k_buffer[2][9].fill_(-1.0)  # and what the forward writes, the daemon reads
    assert bool((daemon.layers[2][0, 9] == -1.0).all())
    assert [(k.data_ptr(), v.data_ptr()) for k, v in zip(kv_pool.k_buffer, kv_pool.v_buffer)] == before


def test_buffers_that_are_not_the_model_runners_are_refused():
    kv_pool = sglang_like_mha()
    shared = share_device_pool(kv_pool, PAGE)
    runner = sglang_like_mha()  # another pool: what a move or a re-allocation would leave
    with pytest.raises(PoolNotShareable, match="layer 0"):
        check_in_place(shared, runner)
    kv_pool.k_buffer[1] = kv_pool.k_buffer[1].clone()  # one layer moved after the regions were taken
    with pytest.raises(PoolNotShareable, match="layer 1: .* handed, .* held"):
        check_in_place(shared, kv_pool)


def test_a_pointer_table_that_names_other_buffers_is_refused():
    kv_pool = sglang_like_mha()
    shared = share_device_pool(kv_pool, PAGE)
    kv_pool.v_data_ptrs = torch.tensor([p + 64 for p in kv_pool.v_data_ptrs.tolist()], dtype=torch.uint64)
    with pytest.raises(PoolNotShareable, match="v_data_ptrs"):
        check_in_place(shared, kv_pool)


def test_a_pool_outside_shared_memory_is_refused_on_a_host_without_cuda():
    with pytest.raises(PoolNotShareable, match="not in shared memory"):
        share_device_pool(sglang_like_mha(shared=False), PAGE)


def test_cuda_buffers_without_an_ipc_handle_are_refused_with_the_reason():
    from cpcache.integrations.sglang.pool import cuda_ipc_fields

    class OutsideTheCachingAllocator:  # what _share_cuda_ does for memory-saver or VMM allocations
        def _share_cuda_(self):
            raise RuntimeError("cannot share memory not allocated by the caching allocator")

    with pytest.raises(PoolNotShareable, match="--enable-memory-saver"):
        cuda_ipc_fields(OutsideTheCachingAllocator())  # type: ignore[arg-type]


def test_a_cuda_handle_names_its_gpu_by_uuid_beside_the_index(monkeypatch):
    """The daemon's index of the scheduler's GPU may differ (another
    CUDA_VISIBLE_DEVICES): the UUID says which GPU it is."""
    from cpcache.integrations.sglang.pool import cuda_ipc_fields

    class SharedStorage:
        def _share_cuda_(self):
            return (1, b"handle", 4096, 512, b"/torch_rc", 0, b"event", True)

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(uuid=f"uuid-of-{index}"))
    fields = cuda_ipc_fields(SharedStorage())  # type: ignore[arg-type]
    assert fields["device"] == 1 and fields["device_uuid"] == "uuid-of-1" and fields["storage_offset"] == 512


def test_a_pool_that_declares_a_part_cpcache_does_not_know_is_refused_with_the_part_named():
    kv_pool = sglang_like_mha()
    kv_pool.host_pool_decls = lambda: (SimpleNamespace(pool_name="kv"), SimpleNamespace(pool_name="mamba"))
    with pytest.raises(ValueError, match="keeps mamba beside the KV"):
        share_device_pool(kv_pool, PAGE)
    kv_pool.host_pool_decls = lambda: (SimpleNamespace(pool_name="kv"), SimpleNamespace(pool_name="indexer"))
    with pytest.raises(ValueError, match="MHA pool with indexer"):
        share_device_pool(kv_pool, PAGE)
    kv_pool.host_pool_decls = lambda: (SimpleNamespace(pool_name="kv"),)
    assert share_device_pool(kv_pool, PAGE).geometry.kv_kind == "mha"


LATENT = 24
INDEX_ROW = PAGE * 132  # a page's index keys (128 bytes a token), then their scales (4 bytes a token)


def sglang_like_dsa() -> SimpleNamespace:
    """What SGLang's DSATokenToKVPool holds once the plugin allocated it: the
    latent per token and the indexer's (index pages, bytes) per layer, in one
    memfd (`shared_memory._rehome_with_index_keys`)."""
    rows, index_pages = SIZE + PAGE, (SIZE + PAGE + 1) // PAGE
    pool = SimpleNamespace(layer_num=LAYERS, kv_cache_dim=LATENT, store_dtype=torch.bfloat16, size=SIZE,
                           page_size=PAGE, index_page_size=PAGE, skip_topk_layers=[False] * LAYERS,
                           host_pool_decls=lambda: (SimpleNamespace(pool_name="kv"),
                                                    SimpleNamespace(pool_name="indexer")))
    kv_bytes = LAYERS * rows * LATENT * 2
    memory = SharedMemory.create(kv_bytes + LAYERS * index_pages * INDEX_ROW)
    setattr(pool, _ATTRIBUTE, memory)
    flat = memory.bytes()
    blocks = flat[:kv_bytes].view(torch.bfloat16).view(LAYERS, rows, 1, LATENT)
    pool.kv_buffer = [blocks[layer] for layer in range(LAYERS)]
    pool.data_ptrs = torch.tensor([b.data_ptr() for b in pool.kv_buffer], dtype=torch.uint64)
    index = flat[kv_bytes:].view(LAYERS, index_pages, INDEX_ROW)
    pool.index_k_with_scale_buffer = [index[layer] for layer in range(LAYERS)]
    return pool


def test_a_dsa_pool_shares_its_indexer_as_a_part_of_every_page_where_it_lies():
    kv_pool = sglang_like_dsa()
    shared = share_device_pool(kv_pool, PAGE)
    g = shared.geometry
    assert g.kv_kind == "mla" and g.part_names == ("kv", "indexer")
    assert g.beside[0].width == INDEX_ROW and g.beside[0].rows_per_page == 1 and g.beside[0].dtype == "uint8"
    assert len(shared.regions) == 2 * LAYERS  # the KV's layers, then the indexer's
    check_in_place(shared, kv_pool)
    daemon = DevicePool.from_fd(os.dup(shared.fd), g, shared.device_pages, shared.regions)
    indexer = daemon.parts[1]
    indexer.layer_pages(2, 5).fill_(0xAB)  # what a load writes: layer 2's indexer row of page 5
    assert bool((kv_pool.index_k_with_scale_buffer[2][5] == 0xAB).all())
    assert not kv_pool.index_k_with_scale_buffer[2][4].any() and not kv_pool.index_k_with_scale_buffer[1].any()
    kv_pool.kv_buffer[0][9].fill_(3.0)  # and what the forward writes, the daemon reads
    assert bool((daemon.layers[0][0, 9] == 3.0).all())


def test_dsa_pools_cpcache_cannot_store_whole_are_refused_with_the_reason():
    kv_pool = sglang_like_dsa()
    kv_pool.skip_topk_layers = [False, True, False]
    with pytest.raises(ValueError, match="shares top-k between layers"):
        share_device_pool(kv_pool, PAGE)
    kv_pool = sglang_like_dsa()
    kv_pool.index_page_size = PAGE // 2  # index keys pooled, or split over DCP ranks
    with pytest.raises(ValueError, match="DSA index pages of 2 tokens under KV pages of 4"):
        share_device_pool(kv_pool, PAGE)
