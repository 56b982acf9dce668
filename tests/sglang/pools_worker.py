"""Run in SGLang's environment by test_sglang_pools.py: SGLang's own MLA and
DSA (DeepSeek V3.2's MLA plus the indexer's keys and scales) device pools,
built on this CPU host with the cpcache plugin's shared-memory allocation,
handed to the daemon's side as the backend hands them (`share_device_pool`,
`DevicePool.from_fd`), and a DSA page taken through every tier and back
into SGLang's own buffers with the daemon's movers. Prints one JSON line of
outcomes."""

from __future__ import annotations

import json
import os
import tempfile

import torch
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MLATokenToKVPool
from sglang.srt.runtime_context import get_parallel

from cpcache.dataplane.movers import DEVICE, HOST, STORAGE, Tiers, Transfers
from cpcache.dataplane.pools import DevicePool, HostPool
from cpcache.dataplane.storage import open_backend
from cpcache.integrations.sglang import shared_memory
from cpcache.integrations.sglang.pool import check_in_place, share_device_pool

PAGE = 64  # DSA's indexer takes 64-token pages only
LATENT, ROPE, LAYERS = 512, 64, 2
PAGES = [1, 3]  # the device pages taken through the tiers


def pages_of(dsa, pages: list[int]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Those pages of every buffer of SGLang's pool, as bytes: the latent of each layer, then the indexer's."""
    rows = [r for p in pages for r in range(p * PAGE, (p + 1) * PAGE)]
    out = [dsa.kv_buffer[layer][rows].contiguous().view(torch.uint8) for layer in range(LAYERS)]
    return out + [dsa.index_k_with_scale_buffer[layer][pages].clone() for layer in range(LAYERS)]


def scribble(dsa) -> None:  # type: ignore[no-untyped-def]
    """What a forward leaves in the pool: every byte of every buffer."""
    generator = torch.Generator().manual_seed(7)
    for buffer in [*dsa.kv_buffer, *dsa.index_k_with_scale_buffer]:
        raw = buffer.view(torch.uint8) if buffer.dtype != torch.uint8 else buffer
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def wipe(dsa) -> None:  # type: ignore[no-untyped-def]
    for buffer in [*dsa.kv_buffer, *dsa.index_k_with_scale_buffer]:
        buffer.zero_()


# Outside a server nothing publishes `--radix-cache-backend cpcache`: say it is chosen.
shared_memory._backend_selected = lambda: True  # type: ignore[assignment]
shared_memory.install()
with get_parallel().override(attn_dcp_size=1):
    dsa = DSATokenToKVPool(size=4 * PAGE, page_size=PAGE, kv_lora_rank=LATENT, dtype=torch.bfloat16,
                           qk_rope_head_dim=ROPE, layer_num=LAYERS, device="cpu", index_head_dim=128,
                           enable_memory_saver=False, kv_cache_dim=LATENT + ROPE)
mla = MLATokenToKVPool(4 * PAGE, PAGE, torch.bfloat16, LATENT, ROPE, LAYERS, "cpu", False)
result: dict = {"dsa_parts": [str(decl.pool_name.value) for decl in dsa.host_pool_decls()],
                "mla_geometry": repr(share_device_pool(mla, PAGE).geometry)}

shared = share_device_pool(dsa, PAGE)
check_in_place(shared, dsa)  # the buffers handed over are the ones SGLang's forward uses
result["dsa_geometry"] = repr(shared.geometry)
result["dsa_regions"] = len(shared.regions)
daemon = DevicePool.from_fd(os.dup(shared.fd), shared.geometry, shared.device_pages, shared.regions)

class Counter:
    """SGLang's layer-transfer counter as the overlapped load-back registers it: what was waited for."""

    def __init__(self) -> None:
        self.waited: list[int] = []

    def wait_until(self, layer: int) -> None:
        self.waited.append(layer)


# The indexer reads a layer's index keys only once that layer of a load-back landed (the daemon
# publishes a layer once every part of it did): SGLang's own reads wait on the pool's counter.
counter = Counter()
dsa.register_layer_transfer_counter(counter)
dsa.get_index_k_with_scale_buffer(1)
result["index_read_waits_for"] = counter.waited
dsa.register_layer_transfer_counter(None)

scribble(dsa)
before = pages_of(dsa, PAGES)
with tempfile.TemporaryDirectory() as root:
    storage = open_backend("file", root=root, geometry_fingerprint=shared.geometry.fingerprint())
    host = HostPool(shared.geometry, pages=4)
    transfers = Transfers(Tiers(host, daemon, storage), threads=2)
    keys = [f"page-{p}" for p in PAGES]
    assert transfers.submit((DEVICE, HOST), PAGES, [0, 1]).result().success
    assert transfers.submit((HOST, STORAGE), [0, 1], keys).result().success
    wipe(dsa)
    for part in host.parts:
        part.tensor.zero_()
    result["stored_bytes"] = [os.path.getsize(storage.path(k)) for k in keys]
    result["read_back"] = transfers.submit((STORAGE, HOST), keys, [2, 3]).result().pages_done
    assert transfers.submit((HOST, DEVICE), [2, 3], PAGES).result().success
    after = pages_of(dsa, PAGES)
    result["equal_buffers"] = [bool(torch.equal(a, b)) for a, b in zip(before, after)]
    result["other_pages_zero"] = not any(b[: PAGE].any() for b in dsa.kv_buffer) and not any(
        b[0].any() for b in dsa.index_k_with_scale_buffer)
    # A part lost: the second page's object ends before its indexer bytes.
    path = storage.path(keys[1])
    os.truncate(path, os.path.getsize(path) - shared.geometry.parts[1].page_bytes)
    result["after_part_lost"] = [storage.exists_prefix(keys), transfers.submit((STORAGE, HOST), keys, [0, 1])
                                 .result().pages_done]
    transfers.close()
print(json.dumps(result))
