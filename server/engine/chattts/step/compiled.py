"""The token step compiled by inductor on the CPU (``--compile-step on`` or ``ahead``).

An eager CPU step is hundreds of small operator calls per token (norms, rotary, residuals,
the attention's casts and masks, sampling) around the 140 projections, each paying
Python and dispatcher overhead on tensors of a few rows; at batch 1 that overhead is a third
of the step. ``torch.compile`` fuses it into a few generated C++ loops; the projections stay
transformers' ``nn.Linear`` (or the int8 forms of :mod:`.linear` and :mod:`.w8a8`), since the
opaque oneDNN weight of :class:`server.engine.chattts.step.linear.PackedLinear` cannot be traced.

Two ways to compile. ``--compile-step ahead`` (the realtime profile's, with w8a8) builds the
graphs ahead of time (:mod:`.aot`: ``aot_compile``), saves them in the cache's folder, and a
restart loads them in seconds without tracing. ``--compile-step on`` compiles lazily at
warm-up, with inductor's ``freezing`` (the weights as constants, the bf16 projections prepacked
for oneDNN); a restart finds inductor's C++ in the folder but traces again (dynamo,
AOTAutograd, freezing): minutes on two cores. Graphs built ahead are not frozen, because
freezing cannot be saved: with it ``aot_compile`` fails in AOTAutograd's cache entry
(``AssertionError: expected OutputCode, got <class 'function'>``,
``_aot_autograd/autograd_cache.py``: a frozen graph's compiled function is a wrapper, not
inductor's output code). For the w8a8 step that costs nothing: its projections are FBGEMM
calls on weights the modules packed themselves, and the generated kernels of the two forms are
the same but for how the weights arrive (arguments rather than constants). On a quiet 2-core
EPYC (full-size model, 256 positions, best of 40 calls, one process each, back to back):
12.67 ms at batch 1 and 21.04 ms at batch 8 ahead of time, against 12.51 and 20.79 ms frozen
(``bench/results/cpu/``; an earlier A/B that found the unfrozen step 1.2-1.5x slower ran
beside other processes, which slow this step several-fold). The bf16 step
(``--quantize none``) loses by not freezing (38 ms at batch 1 unfrozen against 22 ms frozen,
measured once on a shared machine), so it compiles lazily and frozen.

One compile with dynamic shapes serves the whole closed bucket set: dynamo specializes a
batch of 1 (its 0/1 rule), so there are two graphs (batch 1, and every larger batch), each for
every attention length. There were four: a view of all of a slot's positions is contiguous
where any shorter one is not, and the contiguity checks in the attention's inputs (the dense
matmul's, then the C++ operator's through AOTAutograd) made the longest length a graph of its
own. A compiled step's KV slots (and the positions' columns its mask is cut from) hold one
spare position past the longest length
(:data:`~server.engine.chattts.step.runner.SPARE_POSITIONS`), so no step views a whole slot
(``TORCH_LOGS=recompiles``; ``bench/results/cpu/graphs-epyc-2core.md``). Batch 1 keeps its
own graph: sharing one would mean stepping it as two rows (the single stream's latency) or an
unbacked batch size, neither measured. Measured
on this project's 2-core AMD EPYC (full-size model, bf16): the step at batch 1 takes
22-25 ms against 37-38 ms eager and prepacked, 31-32 ms at batch 8 over 512 positions
against about 46; end to end 1.13x the audio per second at one stream and 1.06x at eight
(``git show 715c3f5:bench/results/cpu_realtime_epyc_compiled.md``; today's runs:
``bench/results/cpu/``). Compiling the two graphs takes 4 to 7 minutes on those two cores.
With a :class:`~.compile_cache.CompileCache` (the engine gives one: the server's cache dir)
what was compiled is kept in a folder keyed by torch, the CPU, the model, the step's form and
code and the way it was compiled, so a stale artifact is never loaded; ``chattts-stream
compile`` fills it before the server starts.

A graph built ahead of time keeps its shape guards (:mod:`.aot`); a step whose shape they
refuse (one warm-up did not meet: warm-up runs every graph at its shortest and longest length)
runs eagerly, logged once and counted (``misses``), instead of stalling every stream for a
compile in the middle of serving. The lazily compiled step gets the same from
``fail_on_recompile``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from server.engine.chattts.options import EngineOptions
from server.engine.chattts.step import aot
from server.engine.chattts.step.aot import Compiler
from server.engine.chattts.step.compile_cache import CompileCache, step_facts
from server.engine.chattts.step.graphs import Shape, StepFn, lengths_by_batch

log = logging.getLogger(__name__)


#: The attention length each graph is first compiled at (see :func:`compile_order`): about what
#: a stream attends over in its first seconds (a prompt of 50 to 150 tokens, then 47 a second).
HINT_LENGTH = 256


def compile_order(shapes: Sequence[Shape]) -> list[Shape]:
    """The shapes warm-up runs, in order: each batch size at its shortest and longest length.

    Inductor chooses kernels by the sizes of the call that compiles a graph (its size hints),
    and the first call of batch 1, and of the first larger batch, compiles the graph that
    every other length of that batch class shares: so those two run first at
    :data:`HINT_LENGTH` (the bucket holding it), a typical length rather than the shortest
    (a precaution: the difference was not measured): two graphs. The shortest and longest
    lengths of every batch run too, compiling nothing: a shape that did need a graph of its
    own (a guard the spare KV position does not cover) is met here rather than stepped
    eagerly while serving.
    """
    order: list[Shape] = []
    for i, (batch, seen) in enumerate(lengths_by_batch(shapes).items()):
        if i < 2:  # batch 1 and the first batch above it: the two graphs' first calls
            hint = next((n for n in seen if n >= HINT_LENGTH), seen[0])
            order.append((batch, hint if hint < seen[-1] else seen[0]))
        order += [(batch, n) for n in sorted({seen[0], seen[-1]}) if (batch, n) not in order]
    return order


def graph_hints(shapes: Sequence[Shape]) -> dict[str, Shape]:
    """Each graph's name and the shape it is built at: its batch class's first in :func:`compile_order`."""
    hints: dict[str, Shape] = {}
    for batch, length in compile_order(shapes):
        hints.setdefault(aot.graph_name(batch), (batch, length))
    return hints


class CompiledRunner:
    """Builds or loads the compiled graphs at :meth:`prepare` (warm-up) and runs them in :meth:`run`.

    Args:
        step: the static step.
        compiler: ``torch.compile`` (tests pass a failing one to exercise the fallback).
        ahead_of_time: build the graphs ahead of time (:mod:`.aot`) rather than lazily, frozen.
    """

    kind = "compiled"

    def __init__(
        self, step: StepFn, *, compiler: Compiler = torch.compile, ahead_of_time: bool = False
    ) -> None:
        self._step = step
        self._compiler = compiler
        #: The graphs by :func:`.aot.graph_name`: batch 1, and every larger batch.
        self._graphs: dict[str, StepFn] = {}
        self._prepared = False
        #: Build the graphs ahead of time and save them (else: compile lazily, frozen; see the module).
        self.ahead_of_time = ahead_of_time
        self._lazy: StepFn | None = None
        self._cache: CompileCache | None = None
        self._facts: dict[str, str] = {}
        #: Steps run eagerly because no graph's guards covered their shape (should stay 0).
        self.misses = 0

    def use_cache(self, cache: CompileCache, facts: Mapping[str, str]) -> None:
        """At :meth:`prepare`, load from (or save into) the folder for ``facts`` (:func:`.step_facts`)."""
        self._cache, self._facts = cache, dict(facts)

    def prepare(self, shapes: Sequence[Shape]) -> None:
        """Load the graphs from the cache's folder, or build (and save) them; then run the warm-up shapes.

        Raises whatever the compiler raised (no C++ compiler, an operator inductor cannot
        lower): the engine then falls back to the eager step, loudly.
        """
        if not self.ahead_of_time:
            self._prepare_frozen(shapes)
            return
        began = time.perf_counter()
        hints = graph_hints(shapes)
        if self._cache is None:
            self._graphs = {
                name: aot.build(self._step, shape, self._compiler)[0] for name, shape in hints.items()
            }
            loaded, where = 0, "nowhere (no cache dir: compiled again at every start)"
        else:
            facts = {**self._facts, "compiled": "ahead", "shapes": " ".join(f"{b}x{n}" for b, n in shapes)}
            with self._cache.open(facts) as folder:
                loaded = self._load_or_build(hints, folder / aot.FOLDER)
                self._cache.seal(folder, facts)
            where = str(folder)
        self._prepared = True
        for batch, length in compile_order(shapes):  # warm-up: every graph, shortest and longest
            self.run(batch, length)
        log.info(
            "compiled the token step (inductor) in %.1f s: %d of %d graphs' code from %s",
            time.perf_counter() - began,
            loaded,
            len(hints),
            where,
        )

    def _load_or_build(self, hints: Mapping[str, Shape], folder: Path) -> int:
        """Load each graph saved in ``folder``, build and save the rest: how many loaded."""
        loaded = 0
        for name, shape in hints.items():
            path = folder / f"{name}.pt"
            if path.exists():
                try:
                    self._graphs[name] = aot.load(path, self._step)
                    loaded += 1
                    continue
                except Exception as exc:  # another engine in this process, or unreadable: build it
                    log.warning("compiled graph %s not loaded (%s): compiling afresh", path, exc)
            graph, constants = aot.build(self._step, shape, self._compiler)
            aot.save(graph, constants, path, self._step)
            self._graphs[name] = graph
        return loaded

    def _prepare_frozen(self, shapes: Sequence[Shape]) -> None:
        """Compile lazily, frozen: the warm-up shapes' first calls compile (into the cache's folder)."""
        import torch._inductor.config as inductor_config
        from torch._dynamo.utils import counters

        began = time.perf_counter()
        before = {k: counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}
        lazy = self._compiler(aot.traced(self._step), dynamic=True)
        facts = {**self._facts, "compiled": "frozen", "shapes": " ".join(f"{b}x{n}" for b, n in shapes)}
        opened = contextlib.nullcontext(None) if self._cache is None else self._cache.open(facts)
        with opened as folder:
            # Compiling happens at these first calls, so freezing is patched in around them
            # (``torch.compile(options={"freezing": True})`` did not freeze this step's weights).
            with inductor_config.patch(freezing=True):
                for batch, length in compile_order(shapes):
                    lazy(batch, length)
            if self._cache is not None and folder is not None:
                self._cache.seal(folder, facts)
        self._lazy, self._prepared = lazy, True
        hits, misses = (counters["inductor"][k] - n for k, n in before.items())
        log.info(
            "compiled the token step (inductor) in %.1f s: %d of %d graphs' code from %s%s",
            time.perf_counter() - began,
            hits,
            hits + misses,
            folder or "inductor's default cache",
            # bf16 projections frozen into oneDNN tensors: inductor's FX-graph cache bypasses them
            "" if hits + misses else " (inductor's cache bypassed this step: a restart compiles it again)",
        )

    def run(self, batch: int, length: int) -> None:
        """One compiled step; eagerly if no graph serves this shape (before :meth:`prepare` too)."""
        if self._lazy is not None:
            try:
                with torch.compiler.set_stance("fail_on_recompile"):
                    self._lazy(batch, length)
                return
            except RuntimeError as exc:
                if "recompile" not in str(exc).lower():
                    raise
        graph = self._graphs.get(aot.graph_name(batch))
        if graph is not None:
            try:
                graph(batch, length)
                return
            except RuntimeError as exc:
                if not aot.is_guard_failure(exc):
                    raise
        if self._prepared:
            if not self.misses:
                log.warning(
                    "no compiled graph serves the token step at %s: stepping eagerly", (batch, length)
                )
            self.misses += 1
        self._step(batch, length)


def use_compile_cache(runner: object, options: EngineOptions, model_dir: Path, dtype: torch.dtype) -> None:
    """Give a compiled runner the engine's :class:`CompileCache` (``options.compile_cache_dir``), keyed.

    And build its graphs ahead of time only under ``options.compile_ahead`` (the module says why
    not always). Anything else (another runner, no cache dir) is left as it is.
    """
    if isinstance(runner, CompiledRunner):
        runner.ahead_of_time = options.compile_ahead
    if options.compile_cache_dir is not None and isinstance(runner, CompiledRunner):
        facts = step_facts(model_dir=model_dir, dtype=dtype, quantize=options.quantize)
        runner.use_cache(CompileCache(Path(options.compile_cache_dir)), facts)
