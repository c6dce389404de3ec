"""The engine's compiled token step, each form on a fresh load of the model, timed beside its int8 floor.

The runner freezes (or builds ahead) its graphs around the weights it was compiled with, so a
compiled form cannot share :mod:`bench.cpu.step`'s swappable layers: each gets an engine of its
own, loaded and closed here. In every round the int8 weight-read floor (:mod:`bench.cpu.floors`)
is timed right beside the step, in the same process: a VM's memory speed moves between
processes and within the hour by more than the margin the step is held to (issue #46's
step ÷ floor), and a floor from another process or another minute would add that drift to the
ratio.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from bench.cpu.rig import bf16_cpu_engine, fill_slots, median_ms, record
from server.engine.chattts.step import w8a8_vnni

#: A kernel's floor for a batch: ``int8_floor(...)["vnni"](batch)`` is one call reading the weights.
Floors = dict[str, Callable[[int], Callable[[], torch.Tensor]]]


def paired_floor_row(name: str) -> str:
    """The row of the int8 floor timed beside compiled row ``name`` (``{row}@{batch}`` keys)."""
    return f"{name}:floor-int8"


def compiled_step(
    model_dir: Path,
    quantize: str,
    batches: list[int],
    length: int,
    rounds: int,
    iterations: int,
    floors: Floors | None = None,
) -> tuple[str, dict[str, Any]]:
    """The engine's compiled token step (``--compile-step on``) on a fresh load of the model.

    ``quantize``: ``bf16`` (none), ``int8``, ``w8a8`` or ``w8a8-ahead`` (built ahead of time, as
    ``--compile-step ahead``), ``w8a8-fbgemm-ahead`` (the same with FBGEMM's products where the
    VNNI kernel would run: the default before it). Returns the row name and, per ``name@batch``, the
    wall and CPU ms of every round (plus ``compile_s``: the runner's ``prepare`` at these shapes).
    With ``floors`` (:func:`bench.cpu.floors.int8_floor`), every round also times the int8 floor
    beside the step: row :func:`paired_floor_row`, each round the faster kernel.
    """
    name = "step-compiled" if quantize == "bf16" else f"step-compiled-{quantize}"
    form, *rest = quantize.split("-")
    fbgemm = mock.patch.object(w8a8_vnni, "available", lambda: False) if "fbgemm" in rest else nullcontext()
    with fbgemm:  # the products are chosen at load, the compile key's kernel when the runner is prepared
        engine = bf16_cpu_engine(
            model_dir,
            max_batch=max(batches),
            compile_step=True,
            compile_ahead="ahead" in rest,
            quantize="none" if form == "bf16" else form,
        )
        try:
            timing = _time_compiled(engine, name, batches, length, rounds, iterations, floors or {})
        finally:
            engine.close()
    return name, timing


def _time_compiled(
    engine: Any, name: str, batches: list[int], length: int, rounds: int, iterations: int, floors: Floors
) -> dict[str, Any]:
    """One compiled form's timings (:func:`compiled_step`): the step and its floor, round by round."""
    batch_runner = engine._batch
    timing: dict[str, Any] = {}

    with torch.inference_mode():
        fill_slots(engine, max(batches), length)
        began = time.perf_counter()
        batch_runner.prepare_runner([(b, length) for b in batches])
        timing["compile_s"] = time.perf_counter() - began
        if batch_runner.runner_fallback is not None:
            raise RuntimeError(f"{name}: {batch_runner.runner_fallback}")
        for r in range(rounds):
            for batch in batches if r % 2 == 0 else batches[::-1]:
                step = (name, lambda b=batch: batch_runner.runner.run(b, length))
                kernels = [(kernel, for_batch(batch)) for kernel, for_batch in floors.items()]
                # Step first in even rounds, the floor first in odd ones: neither always runs warm.
                cases = [step, *kernels] if r % 2 == 0 else [*kernels, step]
                measured = {row: median_ms(fn, iterations) for row, fn in cases}
                record(timing, f"{name}@{batch}", *measured.pop(name))
                if measured:  # the floor is the faster kernel of the round
                    record(timing, f"{paired_floor_row(name)}@{batch}", *min(measured.values()))
            print(f"[cpu_step] {name} round {r}: load {os.getloadavg()[0]:.1f}", flush=True)
    return timing
