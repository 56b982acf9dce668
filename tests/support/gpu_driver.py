"""The GPU driver (services/gpu-driver/driver.py) and its dependency check
(dependencies.py), loaded by path: they live beside run.sh, outside the package."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def dependencies() -> ModuleType:
    return _load("gpu_driver_dependencies", "dependencies.py")


def driver() -> ModuleType:
    """The driver itself (its phases, run against fakes)."""
    return _load("gpu_driver_driver", "driver.py")


def _load(name: str, file: str) -> ModuleType:
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "services/gpu-driver" / file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]
