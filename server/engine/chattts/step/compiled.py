"""The token step compiled by inductor on the CPU (``--compile-step on``).

An eager CPU step is hundreds of small operator calls per token (norms, rotary, residuals,
the attention's casts and masks, sampling) around the 140 projections, each paying
Python and dispatcher overhead on tensors of a few rows; at batch 1 that overhead is a third
of the step. ``torch.compile`` fuses it into a few generated C++ loops and, with inductor's
``freezing``, treats the weights as constants and prepacks the bf16 projections for oneDNN
itself: what :class:`server.engine.chattts.step.linear.PackedLinear` does eagerly, whose
opaque oneDNN weight inductor cannot trace, so under this runner the projections stay
transformers' ``nn.Linear`` (or :class:`~server.engine.chattts.step.linear.Int8Linear`).

One compile with dynamic shapes serves the whole closed bucket set: dynamo specializes a
batch of 1 (its 0/1 rule), so there are two graphs (batch 1, and every larger batch), each for
every attention length. There were four: a view of all of a slot's positions is contiguous
where any shorter one is not, and the contiguity checks in the attention's matmul (batch 1)
and in the C++ attention's inputs (AOTAutograd, batches) made the longest length a graph of
its own. A compiled step's KV slots hold one spare position past the longest length
(:data:`~server.engine.chattts.step.runner.SPARE_POSITIONS`), so no step views a whole slot
(``TORCH_LOGS=recompiles``; ``bench/results/cpu/graphs-epyc-2core.md``). Batch 1 keeps its
own graph: sharing one would mean stepping it as two rows (the single stream's latency) or an
unbacked batch size, neither measured. Measured
on this project's 2-core AMD EPYC (full-size model, bf16): the step at batch 1 takes
22-25 ms against 37-38 ms eager and prepacked, 31-32 ms at batch 8 over 512 positions
against about 46; end to end 1.13x the audio per second at one stream and 1.06x at eight
(``git show 715c3f5:bench/results/cpu_realtime_epyc_compiled.md``; today's runs:
``bench/results/cpu/``). Compiling
takes 4 to 7 minutes at warm-up on those two cores. With a :class:`~.compile_cache.CompileCache`
(the engine gives one: the server's cache dir) inductor keeps what it compiled there, in a folder
keyed by torch, the CPU, the model, the step's form and its code, so a restart skips inductor's C++ compile
(:mod:`server.engine.chattts.step.compile_cache` says what a restart still repeats).

After warm-up the runner refuses to recompile (``fail_on_recompile``): a shape or guard
warm-up did not meet runs that one step eagerly, logged once, instead of stalling every
stream for a compile in the middle of serving.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from server.engine.chattts.options import EngineOptions
from server.engine.chattts.step.compile_cache import CompileCache, step_facts
from server.engine.chattts.step.graphs import Shape, StepFn, lengths_by_batch

log = logging.getLogger(__name__)

#: ``torch.compile``'s signature as this runner uses it (tests pass one that raises).
Compiler = Callable[..., Any]


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


class CompiledRunner:
    """Compiles the step at :meth:`prepare` (warm-up) and runs the compiled step in :meth:`run`.

    Args:
        step: the static step.
        compiler: ``torch.compile`` (tests pass a failing one to exercise the fallback).
    """

    kind = "compiled"

    def __init__(self, step: StepFn, *, compiler: Compiler = torch.compile) -> None:
        self._step = step

        def token_step(batch: int, length: int) -> None:
            step(batch, length)

        self._compiled: StepFn = compiler(token_step, dynamic=True)
        self._prepared = False
        self._cache: CompileCache | None = None
        self._facts: dict[str, str] = {}
        #: Steps run eagerly because the compiled step would have had to recompile (should stay 0).
        self.misses = 0

    def use_cache(self, cache: CompileCache, facts: Mapping[str, str]) -> None:
        """At :meth:`prepare`, compile into ``cache``'s folder for ``facts`` (:func:`.step_facts`)."""
        self._cache, self._facts = cache, dict(facts)

    def prepare(self, shapes: Sequence[Shape]) -> None:
        """Compile by running every batch size at its shortest and longest attention length.

        Raises whatever the compiler raised (no C++ compiler, an operator inductor cannot
        lower): the engine then falls back to the eager step, loudly.
        """
        from torch._dynamo.utils import counters

        began = time.perf_counter()
        hits, misses = (counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss"))
        if self._cache is None:
            self._compile(shapes)
            where = "inductor's default cache"
        else:
            facts = {**self._facts, "shapes": " ".join(f"{b}x{n}" for b, n in shapes)}
            with self._cache.open(facts) as folder:
                self._compile(shapes)
                self._cache.seal(folder, facts)
            where = str(folder)
        hits = counters["inductor"]["fxgraph_cache_hit"] - hits
        misses = counters["inductor"]["fxgraph_cache_miss"] - misses
        self._prepared = True
        log.info(
            "compiled the token step (inductor) in %.1f s: %d of %d graphs' code from %s%s",
            time.perf_counter() - began,
            hits,
            hits + misses,
            where,
            # bf16 projections frozen into oneDNN tensors: inductor's FX-graph cache bypasses them
            "" if hits + misses else " (inductor's cache bypassed this step: a restart compiles it again)",
        )

    def _compile(self, shapes: Sequence[Shape]) -> None:
        """Run the shapes whose first calls compile the graphs."""
        import torch._inductor.config as inductor_config

        # Compiling happens at these first calls, so freezing is patched in around them.
        # ``torch.compile(options={"freezing": True})`` did not freeze this step's weights:
        # the bf16 projections stayed unpacked, 38 ms at batch 1 against 22 ms frozen.
        with inductor_config.patch(freezing=True):
            for batch, length in compile_order(shapes):
                self._compiled(batch, length)

    def run(self, batch: int, length: int) -> None:
        """One compiled step; eagerly if it would need a new compile."""
        if not self._prepared:
            self._compiled(batch, length)
            return
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                self._compiled(batch, length)
        except RuntimeError as exc:
            if "recompile" not in str(exc).lower():
                raise
            if not self.misses:
                log.warning("the compiled step would recompile at %s: stepping eagerly", (batch, length))
            self.misses += 1
            self._step(batch, length)


def use_compile_cache(runner: object, options: EngineOptions, model_dir: Path, dtype: torch.dtype) -> None:
    """Give a compiled runner the engine's :class:`CompileCache` (``options.compile_cache_dir``), keyed.

    Anything else (another runner, no cache dir) is left as it is.
    """
    if options.compile_cache_dir is not None and isinstance(runner, CompiledRunner):
        facts = step_facts(model_dir=model_dir, dtype=dtype, quantize=options.quantize)
        runner.use_cache(CompileCache(Path(options.compile_cache_dir)), facts)
