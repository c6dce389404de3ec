"""The structure reads at a glance: no import cycle in server/, small modules, layers kept apart."""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "server"


def module_name(path: Path) -> str:
    parts = path.relative_to(SERVER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Each server module → the server modules it imports (type-checking imports included)."""
    modules = {module_name(p): p for p in SERVER.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                candidates = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            found |= {c for c in candidates if c in modules and c != name and c != "server"}
        graph[name] = found
    return graph


def test_no_import_cycle() -> None:
    graph = imports()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                raise AssertionError("import cycle: " + " → ".join(cycle))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_engine_side_knows_no_wire_protocol_and_no_front_end() -> None:
    graph = imports()
    front = {
        "server.protocol",
        "server.connection",
        "server.connection_protocol",
        "server.http_api",
        "server.wyoming_api",
        "server.wyoming_session",
        "server.app",
    }
    for module, deps in graph.items():
        if module.startswith("server.core") or module.startswith("server.engine"):
            assert not deps & front, f"{module} imports {deps & front}"


def test_front_ends_do_not_reach_back_into_the_app() -> None:
    graph = imports()
    front_ends = ("server.connection", "server.connection_protocol", "server.http_api")
    for module in (*front_ends, "server.wyoming_api", "server.wyoming_session", "server.service"):
        assert "server.app" not in graph[module]


def test_no_module_over_400_lines() -> None:
    sizes = {str(p.relative_to(SERVER)): len(p.read_text().splitlines()) for p in SERVER.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 400} == {}
