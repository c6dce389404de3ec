"""The step's test rig: an engine loaded as the rows need it, its KV slots filled, a timer.

Shared by :mod:`bench.cpu.step`, :mod:`bench.cpu.compiled` and the studies that time a step
(``bench.studies.step_attention``, ``bench.studies.omp_spin``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def median_ms(fn: Callable[[], Any], iterations: int) -> tuple[float, float]:
    """Wall and CPU milliseconds per call (CPU: this process, all threads), of the run with the median wall.

    Three runs of ``iterations`` calls after one warm call. CPU time moves much less than wall
    time when other jobs share the cores (a waiting thread uses none), so it shows a change
    on a loaded machine where wall time alone would hide it.
    """
    fn()
    runs = []
    for _ in range(3):
        began, cpu = time.perf_counter(), time.process_time()
        for _ in range(iterations):
            fn()
        wall = 1000 * (time.perf_counter() - began) / iterations
        runs.append((wall, 1000 * (time.process_time() - cpu) / iterations))
    return sorted(runs)[1]


def record(rows: dict[str, Any], key: str, wall: float, cpu: float) -> None:
    """Add one round's wall and CPU ms (:func:`median_ms`) to row ``key`` (``name@batch``) of ``rows``."""
    entry = rows.setdefault(key, {"ms": [], "cpu_ms": []})
    entry["ms"].append(wall)
    entry["cpu_ms"].append(cpu)


def fill_slots(engine: Any, rows: int, length: int) -> None:
    """Give slots ``[0, rows)`` ``length - 1`` cached positions of random keys and values, as a live row has.

    What transformers' row holds too. Without it the step would attend over pages never written,
    which all read as the one shared page of zeros, sitting in the cache: the attention's real
    cost (reading every row's keys and values from memory, about as many bytes as the weights at
    batch 8) would not be measured.
    """
    kv, state = engine._batch.kv, engine._batch.state
    generator = torch.Generator().manual_seed(0)
    for keys, values in zip(kv.keys, kv.values, strict=True):
        for buffer in (keys, values):
            part = buffer[:rows, :, : length - 1]
            part.copy_(torch.randn(part.shape, generator=generator, dtype=part.dtype))
    state.lengths[:rows] = length - 1
    for slot in range(rows):
        kv.cover(slot, length)


def bf16_cpu_engine(model_dir: Path, **options: Any) -> Any:
    """A ``ChatTTSEngine`` on a fresh load of the model: CPU, bf16, these ``EngineOptions``, not warmed up."""
    from server.engine.chattts.assets import load_chat
    from server.engine.chattts.engine import ChatTTSEngine
    from server.engine.chattts.options import EngineOptions

    loaded = load_chat(model_dir=model_dir, device=torch.device("cpu"))
    return ChatTTSEngine(
        loaded, device=torch.device("cpu"), dtype=torch.bfloat16, options=EngineOptions(**options)
    )
