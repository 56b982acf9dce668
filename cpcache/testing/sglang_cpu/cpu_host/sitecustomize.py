"""Imported at start-up by every Python process that has this folder on its
PYTHONPATH, SGLang's spawned schedulers included: on a host without CUDA,
SGLang 0.5.23 imports two GPU-only packages that have no CPU build here.

- `sgl_kernel`: the registry's wheels are CUDA-only. Every CPU kernel on the
  model path is gated by `cpu_has_amx_support()` (false on this host), so the
  layers run plain torch and nothing of the stand-in is ever called.
- `torchvision`: PyPI's build does not load beside the local CPU torch;
  transformers only probes it.

For hosts without CUDA only (the SGLang suite, `cpcache bench sglang`): a real
deployment has both packages.
"""

from __future__ import annotations

import os

import gpu_stubs

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
# torch.compile here compiles C++ with the host's compiler in every
# process's first forward (SGLang compiles its vocabulary-parallel mask at
# tp > 1): 17 s of each tp 2 server's start on this 2-core host, for integer
# ops eager torch computes bit for bit alike. TORCHDYNAMO_DISABLE=0 keeps it.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# Opt-in: only the model modules a server needs imported (model_modules.py;
# the test kit's servers set it; spawned schedulers inherit the result).
if os.environ.get("CPCACHE_TEST_MODEL_ARCHS") and "SGLANG_DISABLED_MODEL_ARCHS" not in os.environ:
    import model_modules

    model_modules.install(os.environ["CPCACHE_TEST_MODEL_ARCHS"])

gpu_stubs.install()

# Opt-in patches of SGLang modules (beside this file, so on the same
# PYTHONPATH): SGLang's own HiCache on this CPU host, for comparison runs
# (hicache_cpu.py); in the torch_native attention backend, prefill context
# parallelism (cp_torch_native.py), DeepSeek's multi-head latent attention
# (mla_torch_native.py, installed after cp_torch_native.py, which it wraps)
# and attention data parallelism (dp_attention_cpu.py); and the prefill side
# of prefill/decode disaggregation (pd_cpu.py).
_OPT_IN = {"CPCACHE_TEST_HICACHE_CPU": "hicache_cpu", "CPCACHE_TEST_CP_TORCH_NATIVE": "cp_torch_native",
           "CPCACHE_TEST_PD_CPU": "pd_cpu", "CPCACHE_TEST_MLA_TORCH_NATIVE": "mla_torch_native",
           "CPCACHE_TEST_DP_ATTENTION_CPU": "dp_attention_cpu"}
for variable, module_name in _OPT_IN.items():
    if os.environ.get(variable) == "1":
        import importlib

        import import_patches

        import_patches.install(importlib.import_module(module_name).PATCHES)
