"""The structure reads at a glance: folders by layer, no import cycle, small modules, layers kept apart.

The rules are by package, so a new module is checked the moment it lands in its folder:

- ``server.engine_api`` is the shared vocabulary: it imports nothing of ours;
- the engine (``server.engine``) knows no scheduler, stream or front end;
- the core (``server.core``, the inference loop) knows no stream or front end;
- the stream layer (``server.streams``, ``server.voices``, ``server.text``) knows no front end;
- front ends (``server.frontends``) reach the model through the stream layer only: never
  ``server.engine`` or ``server.core``;
- nothing imports the composition root (``server.app``) but the command line.

``bench/`` has the same kind of rules, by purpose rather than by layer (``bench/README.md``):

- no module sits directly in ``bench/`` but ``__init__`` and ``__main__`` (the harness's entry);
- the harness (``bench.harness``) imports nothing else of ``bench``;
- the baselines (``bench.baselines``) import the harness only;
- a suite (``bench.cpu``, ``bench.gpu``, ...) imports the harness, the baselines and itself, never
  another suite;
- nothing imports a study (``bench.studies``) but another study;
- ``tests/bench`` has one folder per ``bench`` package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[2] / "server"
BENCH = SERVER.parent / "bench"


def module_name(path: Path) -> str:
    parts = path.relative_to(SERVER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path = SERVER) -> dict[str, set[str]]:
    """Each module under ``root`` → the modules under it that it imports (type-checking imports included)."""
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
            found |= {c for c in candidates if c in modules and c != name and c != root.name}
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


@pytest.mark.parametrize("root", [SERVER, BENCH], ids=["server", "bench"])
def test_no_import_cycle(root: Path) -> None:
    graph = imports(root)
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
    """The server, the bench and the Python client: a module that grows past 400 lines is split by idea."""
    roots = (SERVER, BENCH, SERVER.parent / "client_py" / "src")
    sizes = {
        str(p.relative_to(SERVER.parent)): len(p.read_text().splitlines())
        for root in roots
        for p in root.rglob("*.py")
    }
    assert {name: n for name, n in sizes.items() if n > 400} == {}


def test_no_module_repeats_its_folders_name_as_a_prefix() -> None:
    # engine/chattts_step.py says twice where it lives: the folder is the prefix.
    repeated = [
        str(p.relative_to(SERVER))
        for p in SERVER.rglob("*.py")
        if p.parent != SERVER and p.stem.startswith(p.parent.name.rstrip("s") + "_")
    ]
    assert repeated == []


# --- bench/: folders by purpose ---------------------------------------------------------------

#: The suites: each a package with a ``__main__``, importing the harness and the baselines only.
SUITES = ("bench.cpu", "bench.gpu", "bench.gpu_sim", "bench.chaos", "bench.soak", "bench.words")


def bench_packages() -> set[str]:
    """The folders of ``bench/`` that are packages (``cpu``, ``harness``, ...)."""
    return {p.parent.name for p in BENCH.glob("*/__init__.py")}


def bench_package(module: str) -> str:
    """``bench.chaos.attacks`` → ``bench.chaos``; ``bench.__main__`` → ``bench``."""
    return ".".join(module.split(".")[:2])


def bench_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, deps in sorted(graph.items()):
        own = bench_package(module)
        for dep in sorted(deps):
            theirs = bench_package(dep)
            if theirs in (own, "bench"):
                continue
            if own == "bench.harness":
                found.append(f"{module} imports {dep}: the harness imports nothing else of bench")
            elif own == "bench.baselines" and theirs != "bench.harness":
                found.append(f"{module} imports {dep}: a baseline imports the harness only")
            elif own in SUITES and theirs not in ("bench.harness", "bench.baselines"):
                found.append(f"{module} imports {dep}: a suite imports the harness, never another suite")
            elif theirs == "bench.studies" and own != "bench.studies":
                found.append(f"{module} imports {dep}: nothing imports a study")
    return found


def test_bench_holds_only_its_entry_point_and_packages() -> None:
    loose = sorted(p.name for p in BENCH.glob("*.py") if p.name not in {"__init__.py", "__main__.py"})
    assert loose == [], "a bench module belongs in a folder by purpose (bench/README.md)"
    packages = bench_packages()
    assert {s.removeprefix("bench.") for s in SUITES} <= packages
    assert all((BENCH / s.removeprefix("bench.") / "__main__.py").is_file() for s in SUITES)


def test_suites_import_the_harness_and_not_each_other() -> None:
    assert bench_violations(imports(BENCH)) == []


@pytest.mark.parametrize(
    ("module", "dep"),
    [
        ("bench.chaos.run", "bench.soak.report"),  # a suite borrowing another's module
        ("bench.gpu.run", "bench.cpu.report"),
        ("bench.harness.cli", "bench.baselines.infer"),
        ("bench.baselines.engine", "bench.cpu.step"),
        ("bench.cpu.realtime", "bench.studies.dtype"),
    ],
)
def test_the_bench_rules_catch_a_forbidden_import(module: str, dep: str) -> None:
    graph = imports(BENCH)
    graph[module] = {*graph[module], dep}
    assert any(v.startswith(f"{module} imports {dep}") for v in bench_violations(graph))


def test_tests_bench_follows_the_bench_folders() -> None:
    tests_bench = SERVER.parent / "tests" / "bench"
    folders = {p.name for p in tests_bench.iterdir() if p.is_dir() and p.name != "__pycache__"}
    packages = bench_packages()
    assert folders <= packages, folders - packages
    assert not list(tests_bench.glob("test_*.py")), "a bench test lives in its suite's folder"
