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

Float scalars are specialized while tracing (``specialize_float``): unspecialized, dynamo turns
them into tensors and restarts its analysis (``TensorifyScalarRestartAnalysis``), which
``aot_compile`` does not catch; the step's floats are constants of the engine (the repetition
penalty), so nothing is lost.
"""

from __future__ import annotations

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


def _keep_guards(entries: Sequence[Any]) -> list[bool]:
    return [keep_guard(entry) for entry in entries]


def traced(step: StepFn) -> StepFn:
    """The function dynamo traces: ``step`` in a closure, so a saved graph names it ``external_data``."""

    def token_step(batch: int, length: int) -> None:
        step(batch, length)

    return token_step


def build(step: StepFn, shape: Shape, compiler: Compiler) -> Any:
    """Trace and compile the graph that serves ``shape``'s batch class, with ``shape`` as its size hints.

    Raises whatever compiling raised (no C++ compiler, an operator inductor cannot lower).
    """
    from torch._dynamo import config as dynamo_config

    options = {"guard_filter_fn": _keep_guards}
    compiled = compiler(traced(step), dynamic=True, fullgraph=True, options=options)
    with dynamo_config.patch(specialize_float=True):
        return compiled.aot_compile((shape, {}))


def save(graph: Any, path: Path, step: StepFn) -> None:
    """Write ``graph`` to ``path`` (the step object left out: the loading engine gives its own)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    graph.save_compiled_function(str(path), external_data={STEP: step})


def load(path: Path, step: StepFn) -> StepFn:
    """The graph saved at ``path``, computing with ``step``'s tensors."""
    with path.open("rb") as f:
        graph: StepFn = torch.compiler.load_compiled_function(f, external_data={STEP: step})
    return graph


def is_guard_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a loaded graph refusing a call its guards do not cover."""
    return isinstance(exc, RuntimeError) and str(exc).startswith("GuardManager check failed")
