"""SGLang 0.5.23 on a host without CUDA, for tests: its radix cache runs on
the CPU with ``SGLANG_USE_CPU_ENGINE=1``, once the GPU-only imports are
stubbed (torchvision has no CPU build beside this torch; sgl_kernel is
stubbed by SGLang's own test helper). Import this module before SGLang."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")


class _Stub(types.ModuleType):
    """A module whose every attribute is another stub (and callable)."""

    def __getattr__(self, name: str) -> _Stub:
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _Stub(f"{self.__name__}.{name}")
        sys.modules[sub.__name__] = sub
        setattr(self, name, sub)
        return sub

    def __call__(self, *args: object, **kwargs: object) -> _Stub:
        return self


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):  # noqa: ANN001
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):  # noqa: ANN001
        return _Stub(spec.name)

    def exec_module(self, module):  # noqa: ANN001
        module.__path__ = []
        module.__version__ = "0.0"  # older than anything transformers would use
        module.__file__ = __file__


if not any(isinstance(f, _TorchvisionStub) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionStub())

import warnings  # noqa: E402

warnings.filterwarnings("ignore")

from sglang.test.test_utils import maybe_stub_sgl_kernel  # noqa: E402

maybe_stub_sgl_kernel()
