"""Running the static token step: eagerly, or as one captured CUDA graph per (batch, length) bucket.

The step (:class:`server.engine.chattts.step.token_step.TokenStep`) is a function of two
Python ints that reads and writes only tensors allocated before warm-up, so
it can be captured with ``torch.cuda.CUDAGraph`` and replayed: one launch per
token instead of hundreds of kernel launches from Python. Why hand-captured
graphs rather than ``torch.compile(mode="reduce-overhead")``: the step's
buffers already are static (the KV slots, the slot state), so capture needs
nothing from a compiler; capture of every bucket takes seconds in warm-up,
while inductor compiles each shape for tens of seconds, recompiles on any
guard it did not foresee (transformers' layers, the custom cache), and its
CUDA-graph trees manage their own output buffers, which would copy the
state the engine keeps in place. Graphs share one memory pool and are
captured largest first, so the small ones reuse the big one's memory.

A runner's whole interface is :class:`StepRunner`: ``prepare`` (warm-up: run
or capture every shape serving will use) and ``run``. Tests drive the engine
with a recording runner that checks, on the CPU, what a graph relies on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

#: ``step(batch, length)``: one token for slots ``[0, batch)`` over ``[0, length)``.
StepFn = Callable[[int, int], None]
Shape = tuple[int, int]


def lengths_by_batch(shapes: Sequence[Shape]) -> dict[int, list[int]]:
    """Each batch size of ``shapes`` (ascending) with its attention lengths (ascending)."""
    lengths: dict[int, list[int]] = {}
    for batch, length in shapes:
        lengths.setdefault(batch, []).append(length)
    return {batch: sorted(lengths[batch]) for batch in sorted(lengths)}


class StepRunner(Protocol):
    """Runs the token step at a bucketed shape."""

    #: ``"eager"``, ``"cuda-graphs"`` or ``"compiled"`` (engine info).
    kind: str

    def prepare(self, shapes: Sequence[Shape]) -> None:
        """Meet every shape once before serving (run it, or capture it)."""
        ...

    def run(self, batch: int, length: int) -> None:
        """One token step at this shape."""
        ...


def prepare_or_eager(
    runner: StepRunner, shapes: Sequence[Shape], eager: Callable[[], StepRunner], *, what: str
) -> tuple[StepRunner, str | None]:
    """Prepare ``runner`` at every shape; if a capturing or compiling runner fails, ``eager()``'s.

    A GPU user must never be stopped by code that has not run on their GPU before: the
    failure is logged once, loudly (``<WHAT> FALLBACK``), and returned as the reason for the
    engine's info (``hello``, ``/metrics``). An eager runner failing is a real fault and raises.
    Returns the runner that is prepared and the reason it replaced ``runner`` (``None``: it did not).
    """
    try:
        runner.prepare(shapes)
        return runner, None
    except Exception as exc:
        if isinstance(runner, EagerRunner):
            raise
        cause = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        reason = f"{runner.kind} failed at warm-up: {cause}"
        log.error("%s FALLBACK: %s; running it eagerly (slower)", what.upper(), reason)
        fallback = eager()
        fallback.prepare(shapes)
        return fallback, reason


class EagerRunner:
    """Calls the step directly (the CPU, or ``--cuda-graphs off``)."""

    kind = "eager"

    def __init__(self, step: StepFn) -> None:
        self._step = step

    def prepare(self, shapes: Sequence[Shape]) -> None:
        """Run each batch size at its shortest and longest length before the first request.

        The kernels' shape-dependent state (oneDNN primitives for the projections) depends
        on the batch size only; the attention's temporaries grow with the length, so the
        longest one meets the largest allocations. Running every length too would only
        lengthen start-up (on the CPU, seconds per batch size).
        """
        for batch, seen in lengths_by_batch(shapes).items():
            for length in sorted({seen[0], seen[-1]}):
                self._step(batch, length)

    def run(self, batch: int, length: int) -> None:
        """Run the step."""
        self._step(batch, length)


class CudaGraphRunner:
    """Captures the step once per shape in :meth:`prepare` and replays it in :meth:`run`.

    Args:
        step: the static step.
        device: the CUDA device.
        warm_iterations: eager runs on a side stream before capture (cuBLAS/cuDNN set-up
            must not happen inside a capture).
    """

    kind = "cuda-graphs"

    def __init__(self, step: StepFn, device: torch.device, *, warm_iterations: int = 2) -> None:
        self._step = step
        self._device = device
        self._warm_iterations = warm_iterations
        self._graphs: dict[Shape, torch.cuda.CUDAGraph] = {}
        self._pool: Any = None  # the first graph's memory pool, shared by the rest
        #: Steps run eagerly because their shape was never captured (should stay 0).
        self.misses = 0

    def prepare(self, shapes: Sequence[Shape]) -> None:
        """Warm every new shape on a side stream, then capture each, largest first, in one pool."""
        todo = sorted(set(shapes) - set(self._graphs), reverse=True)
        if not todo:
            return
        began = time.perf_counter()
        side = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            for batch, length in todo:
                for _ in range(self._warm_iterations):
                    self._step(batch, length)
        torch.cuda.current_stream(self._device).wait_stream(side)
        torch.cuda.synchronize(self._device)
        for shape in todo:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(*shape)
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[shape] = graph
        torch.cuda.synchronize(self._device)
        log.info(
            "captured %d CUDA graphs of the token step in %.1f s", len(todo), time.perf_counter() - began
        )

    def run(self, batch: int, length: int) -> None:
        """Replay the shape's graph (or, never expected, run it eagerly)."""
        graph = self._graphs.get((batch, length))
        if graph is None:
            if not self.misses:
                log.warning("token step at %s was never captured: running it eagerly", (batch, length))
            self.misses += 1
            self._step(batch, length)
            return
        graph.replay()
