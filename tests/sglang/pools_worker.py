"""Run in SGLang's environment by test_sglang_pools.py: SGLang's own MLA and
DSA (DeepSeek V3.2's MLA plus the indexer's keys) device pools, built on
this CPU host, handed to cpcache's geometry check. Prints one JSON line of
outcomes."""

from __future__ import annotations

import json

import torch
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MLATokenToKVPool
from sglang.srt.runtime_context import get_parallel

from cpcache.integrations.sglang.pool import geometry_of

PAGE = 64  # DSA's indexer takes 64-token pages only
LATENT, ROPE = 512, 64


def outcome(check, pool) -> str:  # type: ignore[no-untyped-def]
    try:
        geometry = check(pool)
    except Exception as exc:  # noqa: BLE001 - the refusal is the outcome
        return f"refused: {exc}"
    return repr(geometry if not isinstance(geometry, tuple) else geometry[0])


with get_parallel().override(attn_dcp_size=1):
    dsa = DSATokenToKVPool(size=4 * PAGE, page_size=PAGE, kv_lora_rank=LATENT, dtype=torch.bfloat16,
                           qk_rope_head_dim=ROPE, layer_num=2, device="cpu", index_head_dim=128,
                           enable_memory_saver=False, kv_cache_dim=LATENT + ROPE)
mla = MLATokenToKVPool(4 * PAGE, PAGE, torch.bfloat16, LATENT, ROPE, 2, "cpu", False)
result = {
    "dsa_parts": [str(decl.pool_name) for decl in dsa.host_pool_decls()],
    "dsa_device": outcome(lambda p: geometry_of(p, PAGE), dsa),
    "mla_device": outcome(lambda p: geometry_of(p, PAGE), mla),
}
print(json.dumps(result))
