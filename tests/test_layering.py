"""The core never imports gRPC nor reads the environment: it can be embedded
and tested without either."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cpcache"
CORE = [
    "topology.py", "rounds.py", "collective.py", "agreement.py", "liveness.py", "coordinator.py", "cache.py",
    "host_index.py", "local_io.py", "config.py", "geometry.py", "keys.py", "tiers.py", "movers.py", "runtime.py",
    "errors.py", "storage/__init__.py", "storage/file.py", "storage/mooncake.py", "storage/faults.py",
    "storage/mooncake_master.py",
]


def imports_and_environment(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
            yield "os." + node.attr


def test_core_modules_import_no_grpc_and_read_no_environment():
    offenders = {}
    for name in CORE:
        found = [m for m in imports_and_environment(PACKAGE / name)
                 if m.split(".")[0] in ("grpc", "grpc_health") or m.startswith("cpcache.v1")
                 or m.startswith("cpcache.daemon") or m in ("os.environ", "os.getenv")]
        if found:
            offenders[name] = found
    assert not offenders, offenders
