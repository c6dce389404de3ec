"""The structure reads at a glance: folders by layer, no import cycle, small modules, layers kept apart.

The rules are by package, so a new module is checked the moment it lands in its folder:

- ``server.engine_api`` is the shared vocabulary: it imports nothing of ours;
- the engine (``server.engine``) knows no scheduler, stream or front end;
- the core (``server.core``, the inference loop) knows no stream or front end;
- the stream layer (``server.streams``, ``server.voices``, ``server.text``) knows no front end;
- front ends (``server.frontends``) reach the model through the stream layer only: never
  ``server.engine`` or ``server.core``;
- nothing imports the composition root (``server.app``) but the command line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[2] / "server"


def module_name(path: Path) -> str:
    parts = path.relative_to(SERVER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path = SERVER) -> dict[str, set[str]]:
    """Each server module → the server modules it imports (type-checking imports included)."""
    modules = {module_name(p): p for p in root.rglob("*.py")}
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


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


#: (importer package, imported package, why it is forbidden)
FORBIDDEN: tuple[tuple[str, str, str], ...] = (
    ("server.engine", "server.core", "the engine knows nothing of scheduling"),
    ("server.engine", "server.streams", "the engine knows no stream"),
    ("server.engine", "server.frontends", "the engine knows no front end"),
    ("server.core", "server.streams", "the inference loop knows no stream"),
    ("server.core", "server.frontends", "the inference loop knows no front end"),
    ("server.streams", "server.frontends", "streams know no front end"),
    ("server.voices", "server.frontends", "voices know no front end"),
    ("server.text", "server.frontends", "text knows no front end"),
    ("server.audio", "server.frontends", "encoders know no front end"),
    ("server.frontends", "server.engine", "front ends reach the model through the stream layer"),
    ("server.frontends", "server.core", "front ends reach the model through the stream layer"),
)


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps):
            for importer, imported, why in FORBIDDEN:
                if within(module, importer) and within(dep, imported):
                    found.append(f"{module} imports {dep}: {why}")
            if within(dep, "server.app") and module not in {"server.cli", "server.app"}:
                found.append(f"{module} imports {dep}: only the command line builds the app")
            if module == "server.engine_api":
                found.append(f"{module} imports {dep}: the shared vocabulary imports nothing of ours")
    return found


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


def test_layers_import_only_downwards() -> None:
    assert layering_violations(imports()) == []


@pytest.mark.parametrize(
    ("module", "dep"),
    [
        ("server.frontends.http.api", "server.engine.fake"),
        ("server.frontends.wyoming.session", "server.core.client"),
        ("server.core.policy", "server.frontends.codes"),
        ("server.engine.chattts.step.runner", "server.streams.outbox"),
        ("server.streams.service", "server.frontends.websocket.wire"),
        ("server.engine_api", "server.errors"),
        ("server.streams.service", "server.app"),
    ],
)
def test_the_layering_rules_catch_a_forbidden_import(module: str, dep: str) -> None:
    graph = imports()
    graph[module] = {*graph[module], dep}
    assert any(v.startswith(f"{module} imports {dep}") for v in layering_violations(graph))


def test_no_module_over_400_lines() -> None:
    sizes = {str(p.relative_to(SERVER)): len(p.read_text().splitlines()) for p in SERVER.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 400} == {}


def test_no_module_repeats_its_folders_name_as_a_prefix() -> None:
    # engine/chattts_step.py says twice where it lives: the folder is the prefix.
    repeated = [
        str(p.relative_to(SERVER))
        for p in SERVER.rglob("*.py")
        if p.parent != SERVER and p.stem.startswith(p.parent.name.rstrip("s") + "_")
    ]
    assert repeated == []
