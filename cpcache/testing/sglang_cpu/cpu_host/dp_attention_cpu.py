"""Attention data parallelism (`--enable-dp-attention --dp N`) with SGLang
0.5.23's torch_native attention backend, for this CPU-only host. Imported by
sitecustomize.py only when CPCACHE_TEST_DP_ATTENTION_CPU=1; for the SGLang
suite on such hosts only.

Under attention DP every rank runs each forward with the same batch size
(the MLP is shared across DP ranks), so a rank with fewer requests pads its
batch with dummy sequences; on a CPU host SGLang asks the attention backend
what sequence length a dummy gets (`get_cpu_graph_seq_len_fill_value`),
which only SGLang's AMX backend answers, and a torch_native server dies at
its first forward. The answer here is AMX's: 1 (a dummy attends one token of
request slot 0, and its output is dropped).
"""

from __future__ import annotations

from types import ModuleType


def _patch_torch_native(module: ModuleType) -> None:
    module.TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = lambda self: 1


PATCHES = {"sglang.srt.layers.attention.torch_native_backend": _patch_torch_native}
