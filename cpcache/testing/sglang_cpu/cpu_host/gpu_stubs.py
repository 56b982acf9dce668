"""Stand-ins for SGLang's GPU-only imports on a host without CUDA (see
sitecustomize.py beside this file): `install()` puts them on sys.meta_path."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

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
    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] in _STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _Stub(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        setattr(module, "__version__", "0.0")  # noqa: B010  (older than anything that checks a version)
        module.__file__ = __file__



def install() -> None:
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())
