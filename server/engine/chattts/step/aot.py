"""The compiled step's graphs built ahead of time: traced, compiled, saved to files and loaded back.

``torch.compile(...).aot_compile`` runs dynamo, AOTAutograd and inductor once, for one example
call, and returns a function that runs the compiled graph behind its guards; that function is
saved to a file and loaded in a later process in seconds, without tracing anything again (what
inductor's FX-graph cache alone cannot do: there dynamo and AOTAutograd trace at every start).

The step is a function of two ints that reads the engine's tensors through the
:class:`~server.engine.chattts.step.token_step.TokenStep` it closes over. That object is not
saved: it is ``external_data``, handed back to the loaded function by the engine of the new
process, so a loaded graph computes with that engine's weights, KV slots and slot state.

Guards: a loaded graph keeps only its shape guards (the ranges of ``batch`` and ``length`` it
serves, and the sizes of the engine's tensors relative to them) and the global state (grad
mode, inference mode). The other guards (identity of the modules and tensors, their dtypes and
strides) are dropped: they would pickle the engine itself (its KV slots live in an anonymous
``mmap``, which does not pickle), and what they check is what the cache key already fixes
(:mod:`.compile_cache`: torch, the CPU, the model, the step's form and code). A call whose
shapes the kept guards refuse raises; :class:`~.compiled.CompiledRunner` steps it eagerly.

What the graph holds as Python constants is checked once, at load, instead: dynamo's guards on
constants (``CONSTANT_MATCH``, ``EQUALS_MATCH``) are recorded beside the graph at build, by
their source (``step.repetition_penalty``, a W8A8 module's ``handle``, the layers' sizes), and
a graph whose constants the loading engine does not share is compiled again. The handles make
this necessary, not just careful: they count the W8A8 modules a process created, so a second
engine in one process has other handles, and the graph would read the first one's weights.

Float scalars are specialized while tracing (``specialize_float``): unspecialized, dynamo turns
them into tensors and restarts its analysis (``TensorifyScalarRestartAnalysis``), which
``aot_compile`` does not catch; the step's floats are constants of the engine (the repetition
penalty), so nothing is lost.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from server.engine.chattts.step.graphs import Shape, StepFn

#: ``torch.compile``'s signature as the runner uses it (tests pass one whose compile raises).
Compiler = Callable[..., Any]
#: The folder of the cache's key folder that holds the saved graphs.
FOLDER = "aot"
#: The name ``external_data`` gives the step object in a saved graph.
STEP = "step"


def graph_name(batch: int) -> str:
    """The graph serving ``batch``: dynamo specializes a batch of 1, so batch 1 and every larger one."""
    return "batch1" if batch == 1 else "batches"


def keep_guard(entry: Any) -> bool:
    """Whether a saved graph keeps this guard: shapes and the global (grad, inference) state only."""
    return entry.guard_type in ("SHAPE_ENV", "GLOBAL_STATE")


#: The guards on Python constants the graph was traced with; :func:`constants_differ` checks them.
CONSTANT_GUARDS = ("CONSTANT_MATCH", "EQUALS_MATCH")
_PATH = re.compile(r"\.(\w+)|\['([^']*)'\]|\[(\d+)\]")
_IMPORTED = re.compile(r"G\['__import_(\w+)'\]")


def _resolve(name: str, step: StepFn) -> Any:
    """The value a guard's source ``name`` names: ``step.a._modules['0'].b[1]`` or ``G['__import_m'].X``."""
    imported = _IMPORTED.match(name)
    if imported:
        value: Any = importlib.import_module(imported.group(1).replace("_dot_", "."))
        rest = name[imported.end() :]
    elif name.startswith("step"):
        value, rest = step, name[len("step") :]
    else:
        raise LookupError(name)
    at = 0
    for part in _PATH.finditer(rest):
        if part.start() != at:
            raise LookupError(name)
        attribute, key, index = part.groups()
        value = getattr(value, attribute) if attribute else value[key if key is not None else int(index)]
        at = part.end()
    if at != len(rest):
        raise LookupError(name)
    return value


def constants_differ(constants: dict[str, str], step: StepFn) -> str | None:
    """The first constant a saved graph was traced with that ``step`` no longer has (``None``: none).

    The graph holds them as constants, unguarded once saved: the W8A8 modules' handles (a
    counter, so another engine in the process has others), the repetition penalty, the sizes.
    """
    for name, saved in constants.items():
        try:
            now = repr(_resolve(name, step))
        except (LookupError, AttributeError, IndexError, KeyError, ImportError):
            return f"{name}: gone"
        if now != saved:
            return f"{name}: {saved} then, {now} now"
    return None


def traced(step: StepFn) -> StepFn:
    """The function dynamo traces: ``step`` in a closure, so a saved graph names it ``external_data``."""

    def token_step(batch: int, length: int) -> None:
        step(batch, length)

    return token_step


def build(step: StepFn, shape: Shape, compiler: Compiler) -> tuple[Any, dict[str, str]]:
    """Trace and compile the graph that serves ``shape``'s batch class, with ``shape`` as its size hints.

    Returns the graph and the constants it was traced with (guard source → ``repr`` of the value).
    Raises whatever compiling raised (no C++ compiler, an operator inductor cannot lower).
    """
    from torch._dynamo import config as dynamo_config

    constants: dict[str, str] = {}

    def keep_guards(entries: Sequence[Any]) -> list[bool]:
        for entry in entries:
            if entry.guard_type in CONSTANT_GUARDS and entry.has_value:
                constants[entry.name] = repr(entry.value)
        return [keep_guard(entry) for entry in entries]

    options = {"guard_filter_fn": keep_guards}
    compiled = compiler(traced(step), dynamic=True, fullgraph=True, options=options)
    with dynamo_config.patch(specialize_float=True):
        graph = compiled.aot_compile((shape, {}))
    return graph, constants


def save(graph: Any, constants: dict[str, str], path: Path, step: StepFn) -> None:
    """Write ``graph`` to ``path``, its constants beside (the step left out: the loader gives its own)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    graph.save_compiled_function(str(path), external_data={STEP: step})
    path.with_suffix(".json").write_text(json.dumps({"constants": constants}, indent=1, sort_keys=True))


def load(path: Path, step: StepFn) -> StepFn:
    """The graph saved at ``path``, computing with ``step``'s tensors.

    Raises :class:`ValueError` when ``step`` differs from the one it was built with in a constant.
    """
    constants = json.loads(path.with_suffix(".json").read_text())["constants"]
    differ = constants_differ(constants, step)
    if differ is not None:
        raise ValueError(f"built for another step ({differ})")
    with path.open("rb") as f:
        graph: StepFn = torch.compiler.load_compiled_function(f, external_data={STEP: step})
    return graph


def is_guard_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a loaded graph refusing a call its guards do not cover."""
    return isinstance(exc, RuntimeError) and str(exc).startswith("GuardManager check failed")
