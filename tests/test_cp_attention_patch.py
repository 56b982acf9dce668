"""The SGLang suite's prefill-CP patch of torch_native (cpu_host/
cp_torch_native.py) attends each zigzag block's query rows exactly as dense
causal attention over the whole sequence does: both blocks of every rank,
with a cached prefix, with grouped KV heads, several sequences at once."""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from cpcache.testing.sglang_cpu.servers import CPU_HOST

pytestmark = pytest.mark.timeout(60)

spec = importlib.util.spec_from_file_location("cp_torch_native", CPU_HOST / "cp_torch_native.py")
assert spec is not None and spec.loader is not None
patch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(patch)


def zigzag_blocks(extend: int, cp_size: int) -> list[tuple[int, int]]:
    """(start, end) of the 2 * cp_size blocks of an extend, as SGLang splits it."""
    segments = 2 * cp_size
    sizes = [extend // segments + (1 if i < extend % segments else 0) for i in range(segments)]
    ends = list(itertools.accumulate(sizes))
    return [(end - size, end) for size, end in zip(sizes, ends)]


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("cp_size", [2, 3])
def test_each_zigzag_block_attends_as_dense_causal_attention_does(q_heads: int, kv_heads: int, cp_size: int):
    torch.manual_seed(0)
    dim, pool_tokens = 16, 512
    k_cache, v_cache = torch.randn(pool_tokens, kv_heads, dim), torch.randn(pool_tokens, kv_heads, dim)
    sequences = [(40, 37), (0, 90), (13, 8 * cp_size)]  # (cached prefix, extend) per sequence
    req_to_token = torch.zeros(len(sequences), 256, dtype=torch.int64)
    slots = torch.randperm(pool_tokens)
    used = 0
    for seq, (prefix, extend) in enumerate(sequences):
        req_to_token[seq, : prefix + extend] = slots[used : used + prefix + extend]
        used += prefix + extend
    queries = [torch.randn(extend, q_heads, dim) for _, extend in sequences]
    attend = patch._block_attention(k_cache, v_cache, req_to_token, torch.arange(len(sequences)), dim ** -0.5, dim)

    def dense(seq: int) -> torch.Tensor:
        prefix, extend = sequences[seq]
        tokens = req_to_token[seq, : prefix + extend]
        q, k, v = (t.movedim(0, 1).unsqueeze(0) for t in (queries[seq], k_cache[tokens], v_cache[tokens]))
        mask = torch.ones(extend, prefix + extend, dtype=torch.bool).tril(prefix)
        return scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=dim ** -0.5,
                                            enable_gqa=q_heads != kv_heads).squeeze(0).movedim(0, 1)

    for rank in range(cp_size):
        for block in (rank, 2 * cp_size - 1 - rank):  # a rank's two blocks: one early, one late
            rows, kv_lens, cu = [], [], [0]
            for seq, (prefix, extend) in enumerate(sequences):
                start, end = zigzag_blocks(extend, cp_size)[block]
                rows.append(queries[seq][start:end])
                kv_lens.append(prefix + end)
                cu.append(cu[-1] + end - start)
            got = attend(torch.cat(rows), torch.tensor(cu), torch.tensor(kv_lens), max(kv_lens))
            for seq, (_, extend) in enumerate(sequences):
                start, end = zigzag_blocks(extend, cp_size)[block]
                torch.testing.assert_close(got[cu[seq] : cu[seq + 1]], dense(seq)[start:end], rtol=1e-5, atol=1e-5)
