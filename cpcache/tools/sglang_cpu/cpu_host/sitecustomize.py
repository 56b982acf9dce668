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
gpu_stubs.install()

# SGLang's own HiCache on this CPU host, for comparison runs: hicache_cpu.py
# (beside this file, so on the same PYTHONPATH).
if os.environ.get("CPCACHE_TEST_HICACHE_CPU") == "1":
    import hicache_cpu

    hicache_cpu.install()
