"""Imported at start-up by every Python process that has this folder on its
PYTHONPATH, SGLang's spawned schedulers included: on a host without CUDA,
SGLang 0.5.23 imports two GPU-only packages that have no CPU build here.

- `sgl_kernel`: the registry's wheels are CUDA-only. Every CPU kernel on the
  model path is gated by `cpu_has_amx_support()` (false on this host), so the
  layers run plain torch and nothing of the stand-in is ever called.
- `torchvision`: PyPI's build does not load beside the local CPU torch;
  transformers only probes it.

Test support only: a real deployment has both packages.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

_STUBBED = ("sgl_kernel", "torchvision")


class _Stub(types.ModuleType):
    """A module whose every attribute is another stub, and callable."""

    def __getattr__(self, name: str) -> _Stub:
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _Stub(f"{self.__name__}.{name}")
        setattr(self, name, sub)
        return sub

    def __call__(self, *args: object, **kwargs: object) -> _Stub:
        return self


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):  # noqa: ANN001
        if name.split(".")[0] in _STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):  # noqa: ANN001
        return _Stub(spec.name)

    def exec_module(self, module):  # noqa: ANN001
        module.__path__ = []
        module.__version__ = "0.0"  # older than anything that checks a version
        module.__file__ = __file__


if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _StubFinder())

# SGLang's own HiCache on this CPU host, for comparison runs: hicache_cpu.py
# (beside this file, so on the same PYTHONPATH).
if os.environ.get("CPCACHE_TEST_HICACHE_CPU") == "1":
    import hicache_cpu

    hicache_cpu.install()
