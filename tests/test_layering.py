"""The package's rooms and the arrows between them (DESIGN section 10),
checked by directory: a new module is placed by the folder it lives in, not
by a hand-kept list.

    tools -> daemon -> rank -> dataplane -> state -> agreement -> vocabulary
    client -> vocabulary (and the generated wire code)
    integrations -> client -> vocabulary (what runs inside an inference server)

The core (agreement, state, dataplane, rank and the vocabulary) never imports
gRPC nor reads the environment: it can be embedded and tested without either.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cpcache"
VOCABULARY = "vocabulary"  # the top-level modules: errors, values, config, topology, keys, geometry, hashing
ORDER = ["vocabulary", "agreement", "state", "dataplane", "rank", "daemon", "tools"]
# Rooms outside the chain, and what each may import besides itself.
SIDE_ROOMS = {"client": {"vocabulary", "v1"}, "integrations": {"client", "vocabulary", "v1"}, "v1": set()}
CORE = {"vocabulary", "agreement", "state", "dataplane", "rank"}


def room_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "cpcache":
        return None
    if len(parts) == 1:
        return VOCABULARY
    if (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return VOCABULARY


def allowed(room: str) -> set[str]:
    if room in SIDE_ROOMS:
        return SIDE_ROOMS[room] | {room}
    below = set(ORDER[: ORDER.index(room) + 1])
    if room in ("daemon", "tools"):
        below |= {"v1", "client"}
    return below


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        yield path, ".".join(rel.parts)


def imports_of(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
        elif isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
            yield "os." + node.attr


def test_every_folder_is_a_known_room():
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert rooms == set(ORDER[1:]) | set(SIDE_ROOMS)


def test_arrows_only_point_down():
    offenders = []
    for path, name in modules():
        room = room_of(name)
        for imported in imports_of(path):
            target = room_of(imported)
            if target is not None and target not in allowed(room):
                offenders.append(f"{name} ({room}) imports {imported} ({target})")
    assert not offenders, "\n".join(offenders)


def test_core_imports_no_grpc_and_reads_no_environment():
    offenders = []
    for path, name in modules():
        if room_of(name) not in CORE:
            continue
        for imported in imports_of(path):
            grpc_module = imported.split(".")[0] in ("grpc", "grpc_health", "grpc_status")
            if grpc_module or imported in ("os.environ", "os.getenv"):
                offenders.append(f"{name}: {imported}")
    assert not offenders, offenders


def test_client_imports_no_torch():
    offenders = [f"{name}: {m}" for path, name in modules() if room_of(name) == "client"
                 for m in imports_of(path) if m.split(".")[0] in ("torch", "numpy")]
    assert not offenders, offenders
