"""Patches applied to SGLang modules as they are imported: SGLang imports
most of its modules late, in its spawned scheduler processes, so each patch
runs right after its module's own code (an import hook), or at once when
the module is already imported. A module may have several patches (MLA and
prefill CP both patch torch_native): they run in the order installed."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

_PATCHES: dict[str, list[Callable[[ModuleType], None]]] = {}


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then its patch."""

    def __init__(self, inner: importlib.abc.Loader, patches: list[Callable[[ModuleType], None]]) -> None:
        self.inner = inner
        self.patches = patches

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        for patch in self.patches:
            patch(module)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


class _PatchFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        patches = _PATCHES.get(name)
        if patches is None:
            return None
        for finder in sys.meta_path:  # the finder that would have found it
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, patches)
                return spec
        return None


def install(patches: dict[str, Callable[[ModuleType], None]]) -> None:
    for name, patch in patches.items():
        installed = _PATCHES.setdefault(name, [])
        if patch in installed:  # installed twice: patched once
            continue
        installed.append(patch)
        if name in sys.modules:  # imported before this hook: patch in place
            patch(sys.modules[name])
    if not any(isinstance(f, _PatchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchFinder())
