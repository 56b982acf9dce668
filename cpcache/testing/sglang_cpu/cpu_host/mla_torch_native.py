"""Multi-head latent attention (DeepSeek V2/V3's MLA) in SGLang 0.5.23's
torch_native attention backend, for this CPU-only host. Imported by
sitecustomize.py only when CPCACHE_TEST_MLA_TORCH_NATIVE=1; for the SGLang
suite on such hosts only.

An MLA model's pool holds one latent per token (`kv_lora_rank` wide, then
the rotary part), and the model attends two ways (SGLang's dispatch for a
backend it does not know, as for triton):

- a prefill with no cached prefix runs plain multi-head attention (`attn_mha`)
  over the K and V it has just decompressed from the latent, with
  save_kv_cache=False: the latent went into the pool beforehand. GPU
  backends attend that K and V as they are (ragged); torch_native reads K and
  V back from the pool, which holds latents, not per-head K and V, and dies
  at its first prefill on the shape mismatch.
- a prefill over a cached prefix, and every decode, run in the absorbed
  latent space (`attn_mqa`): one KV "head", q·k over the whole latent, values
  its first `kv_lora_rank` columns. torch_native does this right already
  (the pool's key and value buffers are exactly that).

This patch gives the first the ragged attention GPU backends give it,
causal per sequence, with plain SDPA; the second is left to torch_native.

Under prefill CP (`--enable-prefill-cp`), SGLang's dispatch for its GPU
backends (fa3, flashinfer, flashmla) sends every prefill down the absorbed
path, where the FlashAttention backend gathers the latent over the CP ranks
in token order before writing it (`materialize_full_mla_kv`; the multi-head
path would write each rank's own latents against the whole batch's slots);
a backend SGLang does not know gets triton's dispatch, which has no such
rule. The patch gives torch_native that dispatch under CP, gathers each
layer's latent over the CP ranks and writes it whole (on GPUs through a
CUDA-only kernel), then leaves the attention of the rank's zigzag rows to
cp_torch_native.py, which must be installed first (sitecustomize.py's
order; checked).
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch.nn.functional import scaled_dot_product_attention


def _is_latent_pool(pool: object) -> bool:
    return hasattr(pool, "kv_lora_rank") and hasattr(pool, "qk_rope_head_dim")


def _ragged_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extend_seq_lens: list[int],
                   scaling: float) -> torch.Tensor:
    """Each sequence's rows attend causally to its own rows: [tokens, heads, dim]."""
    if sum(extend_seq_lens) != q.shape[0]:
        raise ValueError(f"{q.shape[0]} query rows for sequences of {sum(extend_seq_lens)} tokens")
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
    start = 0
    for n in extend_seq_lens:
        rows = slice(start, start + n)
        out[rows] = scaled_dot_product_attention(
            q[rows].movedim(0, 1).unsqueeze(0), k[rows].movedim(0, 1).unsqueeze(0).to(q.dtype),
            v[rows].movedim(0, 1).unsqueeze(0).to(q.dtype), is_causal=True, scale=scaling).squeeze(0).movedim(0, 1)
        start += n
    return out


def _patch_torch_native(module: ModuleType) -> None:
    from sglang.srt.layers.cp.base import get_cp_strategy
    from sglang.srt.layers.cp.utils import is_cp_active

    backend = module.TorchNativeAttnBackend
    latent_extend = backend.forward_extend
    announced: list[bool] = []

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # type: ignore[no-untyped-def]
        pool = self.token_to_kv_pool
        if not _is_latent_pool(pool):
            return latent_extend(self, q, k, v, layer, forward_batch, save_kv_cache)
        if layer.v_head_dim == pool.kv_lora_rank:  # the absorbed path: values are the latent
            if not is_cp_active(forward_batch):
                return latent_extend(self, q, k, v, layer, forward_batch, save_kv_cache)
            if not getattr(latent_extend, "attends_zigzag_rows", False):
                raise RuntimeError("MLA under prefill CP needs cp_torch_native.py installed first "
                                   "(CPCACHE_TEST_CP_TORCH_NATIVE=1)")
            if save_kv_cache and k is not None:
                latent = get_cp_strategy().gather_kv_cache(k.contiguous(), forward_batch)
                pool.set_kv_buffer(layer, module.KVWriteLoc.for_batch(forward_batch), latent, None)
            return latent_extend(self, q, k, v, layer, forward_batch, save_kv_cache=False)
        if not announced:  # once per process: the suite checks that the patch ran
            announced.append(True)
            logging.getLogger(__name__).info("cpcache test patch: MLA's ragged prefill in torch_native")
        prefixes = forward_batch.extend_prefix_lens_cpu
        if prefixes is not None and any(prefixes):
            raise NotImplementedError("MLA's multi-head prefill over a cached prefix (SGLang dispatches it "
                                      "to the latent path for this backend)")
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        k_ = k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim)
        v_ = v.reshape(-1, layer.tp_v_head_num, layer.v_head_dim)
        out = _ragged_causal(q_, k_, v_, list(forward_batch.extend_seq_lens_cpu), layer.scaling)
        return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    backend.forward_extend = forward_extend


def _patch_dispatch(module: ModuleType) -> None:
    from sglang.srt.layers.cp.utils import is_cp_active

    registry, triton = module.AttentionBackendRegistry, module.handle_attention_triton

    def handle_attention_torch_native(attn, forward_batch):  # type: ignore[no-untyped-def]
        if is_cp_active(forward_batch):
            return module._dispatch_mla_subtype(attn, forward_batch)
        return triton(attn, forward_batch)

    registry.register("torch_native", handle_attention_torch_native)


PATCHES = {"sglang.srt.layers.attention.torch_native_backend": _patch_torch_native,
           "sglang.srt.models.deepseek_common.attention_backend_handler": _patch_dispatch}
