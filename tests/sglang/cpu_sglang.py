"""SGLang 0.5.23 on a host without CUDA, for a test process that was not
started with cpu_host/ (cpcache/testing/sglang_cpu/cpu_host) on its PYTHONPATH
(the worker of test_backend.py): the same stand-ins for its GPU-only imports.
Import this module before SGLang."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "cpcache" / "testing" / "sglang_cpu" / "cpu_host"))

import gpu_stubs  # noqa: E402

gpu_stubs.install()
warnings.filterwarnings("ignore")
