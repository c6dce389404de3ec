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
batch of 1 (its 0/1 rule) and an attention over a whole slot, so there are four graphs
(batch 1 or more, the longest length or any other), each for every other shape. Measured
on this project's 2-core AMD EPYC (full-size model, bf16): the step at batch 1 takes
22-25 ms against 37-38 ms eager and prepacked, 31-32 ms at batch 8 over 512 positions
against about 46; end to end 1.13x the audio per second at one stream and 1.06x at eight
(``git show 715c3f5:bench/results/cpu_realtime_epyc_compiled.md``; today's runs:
``bench/results/cpu/``). Compiling
takes 4 to 7 minutes at warm-up on those two cores (inductor keeps what it compiled on
disk, in ``TORCHINDUCTOR_CACHE_DIR``, so a restart on the same machine compiles less).

After warm-up the runner refuses to recompile (``fail_on_recompile``): a shape or guard
warm-up did not meet runs that one step eagerly, logged once, instead of stalling every
stream for a compile in the middle of serving.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

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
    (a precaution: the difference was not measured). The longest length is a graph of its
    own (dynamo specializes an attention over the whole slot), so it is met too: four graphs.
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
        #: Steps run eagerly because the compiled step would have had to recompile (should stay 0).
        self.misses = 0

    def prepare(self, shapes: Sequence[Shape]) -> None:
        """Compile by running every batch size at its shortest and longest attention length.

        Raises whatever the compiler raised (no C++ compiler, an operator inductor cannot
        lower): the engine then falls back to the eager step, loudly.
        """
        import torch._inductor.config as inductor_config

        began = time.perf_counter()
        # Compiling happens at these first calls, so freezing is patched in around them.
        # ``torch.compile(options={"freezing": True})`` did not freeze this step's weights:
        # the bf16 projections stayed unpacked, 38 ms at batch 1 against 22 ms frozen.
        with inductor_config.patch(freezing=True):
            for batch, length in compile_order(shapes):
                self._compiled(batch, length)
        self._prepared = True
        log.info("compiled the token step (inductor) in %.1f s", time.perf_counter() - began)

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
