"""The package's rooms and the arrows between them (docs/design.md §10),
checked by directory: a new module is placed by the folder it lives in, not
by a hand-kept list.

    tools -> daemon -> rank -> dataplane -> state -> agreement -> vocabulary
    client -> vocabulary (and the generated wire code)
    integrations -> client -> vocabulary (what runs inside an inference server)
    integrations -> dataplane (the store, written directly by a server with
                   no daemon beneath it: SGLang's decode offload)
    tools -> testing -> daemon, dataplane, integrations, client, vocabulary
             (the test and measurement kits: the CLI runs them, they never
             import the CLI)

The core (agreement, state, dataplane, rank and the vocabulary) never imports
gRPC nor reads the environment: it can be embedded and tested without either.
No module imports itself back through others, not even only for type
checking: each arrow between two modules points one way.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "cpcache"
VOCABULARY = "vocabulary"  # the top-level modules: errors, values, config, topology, keys, geometry, hashing, requests
ORDER = ["vocabulary", "agreement", "state", "dataplane", "rank", "daemon", "tools"]
# Rooms outside the chain, and what each may import besides itself.
SIDE_ROOMS = {"client": {"vocabulary", "v1"}, "integrations": {"client", "vocabulary", "v1"}, "v1": set(),
              "testing": {"daemon", "dataplane", "integrations", "client", "vocabulary", "v1"}}
CORE = {"vocabulary", "agreement", "state", "dataplane", "rank"}
# Single modules a room may import beyond its rooms: the storage backends,
# for a server that writes the store with no daemon beneath it.
EXTRA = {"integrations": ("cpcache.dataplane.storage",)}


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
    if room == "tools":
        below |= {"testing"}
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
            extra = any(imported == m or imported.startswith(m + ".") for m in EXTRA.get(room or "", ()))
            if target is not None and target not in allowed(room) and not extra:
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


def module_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The cpcache modules `path` imports at module level (in `if
    TYPE_CHECKING:` blocks too; not inside functions). `from a import b`
    counts as importing module a.b when there is one, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([child.module] if child.module else []))
                found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                             for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in known and m != name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in order:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], order[imported])
        if low[module] == order[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return found


def test_no_import_circle_anywhere():
    paths = {name.removesuffix(".__init__"): path for path, name in modules()}
    graph = {name: module_imports(path, name, set(paths)) for name, path in paths.items()}
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check itself
    assert not circles(graph), circles(graph)
