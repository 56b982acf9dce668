"""Prefill context parallelism (`--enable-prefill-cp --cp-strategy zigzag`)
in SGLang 0.5.23's torch_native attention backend, for this CPU-only host.
Imported by sitecustomize.py only when CPCACHE_TEST_CP_TORCH_NATIVE=1; for
the SGLang suite and `cpcache bench sglang` on such hosts only.

With prefill CP, SGLang shards a prefill's tokens over the CP ranks at the
model's boundary: each rank computes Q, K and V for its own zigzag blocks.
SGLang's GPU backends (fa3, fa4, flashinfer, trtllm_mha, dsa) then do two
things that torch_native does not, so a server with it dies at the first
prefill (it writes rank-local K/V against the whole batch's out_cache_loc):

- gather the rank-local K/V into the KV pool in full token order
  (`strategy.materialize_full_kv`): every CP rank's pool holds the whole
  prefix, as it does without prefill CP;
- attend the rank's own query rows to that full KV
  (`strategy.run_attention`, which splits the rows into the rank's two
  zigzag blocks and calls back with each block's rows and KV length).

This patch does those two steps with plain SDPA; the call-back convention is
FlashAttention's (`flash_attn_with_kvcache` with causal=True: a block's rows
are the last rows of its KV length). The model runner's CP path also asks
for the CUDA stream to gather the hidden states on (the zigzag strategy
ignores it): it gets the CPU's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention


def _block_attention(k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, scaling: float,
                     v_dim: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]:
    """The call-back of `run_attention`: each sequence's query rows attend,
    causally and aligned at the end, to its first `kv_len` pooled tokens."""

    def attend(q: torch.Tensor, cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, _max_q: int) -> torch.Tensor:
        out = q.new_empty((q.shape[0], q.shape[1], v_dim))
        cu, lens = cu_seqlens_q.tolist(), kv_lens.tolist()
        for seq, kv_len in enumerate(lens):
            rows = q[cu[seq] : cu[seq + 1]]
            n = rows.shape[0]
            if n == 0:
                continue
            tokens = req_to_token[req_pool_indices[seq], :kv_len].to(torch.int64)
            key, value = k_cache[tokens].to(q.dtype), v_cache[tokens].to(q.dtype)
            # Row j is the token at position kv_len - n + j: it sees every KV
            # position up to its own.
            positions = torch.arange(kv_len - n, kv_len, device=q.device).unsqueeze(1)
            mask = torch.arange(kv_len, device=q.device).unsqueeze(0) <= positions
            attended = scaled_dot_product_attention(
                rows.movedim(0, 1).unsqueeze(0), key.movedim(0, 1).unsqueeze(0), value.movedim(0, 1).unsqueeze(0),
                attn_mask=mask, scale=scaling, enable_gqa=rows.shape[1] != key.shape[1])
            out[cu[seq] : cu[seq + 1]] = attended.squeeze(0).movedim(0, 1)
        return out

    return attend


def _patch_torch_native(module: ModuleType) -> None:
    from sglang.srt.layers.cp.base import get_cp_strategy
    from sglang.srt.layers.cp.utils import is_cp_active

    backend = module.TorchNativeAttnBackend
    plain_extend = backend.forward_extend
    announced: list[bool] = []

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        if layer.is_cross_attention or not is_cp_active(forward_batch):
            return plain_extend(self, q, k, v, layer, forward_batch, save_kv_cache)
        strategy = get_cp_strategy()
        if not announced:  # once per process: the suite checks that prefill CP ran
            announced.append(True)
            logging.getLogger(__name__).info("cpcache test patch: prefill CP attention (%s) in torch_native, "
                                             "CP rank %d", strategy.name, strategy.cp_rank)
        if save_kv_cache and k is not None and v is not None:
            strategy.materialize_full_kv(forward_batch, layer, k, v)
        attend = _block_attention(self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                                  self.token_to_kv_pool.get_value_buffer(layer.layer_id),
                                  self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                                  layer.scaling, layer.v_head_dim)
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = strategy.run_attention(q_, forward_batch, q.device, attend)
        return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    forward_extend.attends_zigzag_rows = True  # type: ignore[attr-defined]  # what mla_torch_native.py checks
    backend.forward_extend = forward_extend


class _TorchOnCpu(ModuleType):
    """torch, with `torch.cuda.current_stream()` answering the CPU's stream."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = SimpleNamespace(current_stream=lambda device=None: torch.cpu.current_stream())

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _patch_eager_runner(module: ModuleType) -> None:
    module.torch = _TorchOnCpu()  # type: ignore[attr-defined]


PATCHES = {"sglang.srt.layers.attention.torch_native_backend": _patch_torch_native,
           "sglang.srt.model_executor.runner.eager_runner": _patch_eager_runner}
