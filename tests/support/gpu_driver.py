"""The GPU driver's dependency check (services/gpu-driver/dependencies.py),
loaded by path: it lives beside run.sh, outside the package."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def dependencies() -> ModuleType:
    name = "gpu_driver_dependencies"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "services/gpu-driver/dependencies.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]
