"""Stage 2 of :mod:`bench.gpu`, in a child process: token-step time per batch bucket, graphs on and off.

``python -m bench.gpu.step --model-dir DIR --device cuda --out X.json``

The token step has static shapes: at a given (batch, attention length) it runs the same
kernels whichever rows are live, so it is timed on the warmed-up engine with no sequence
at all, as serving runs it: ``runner.run(batch, length)`` and the engine's one host read
per quantum, here after every token (a quantum of 1, the most reads). "graphs" replays the
engine's captured CUDA graphs; "eager" calls the same step from Python (what
``--cuda-graphs off`` and the CPU do).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def time_runner(engine: Any, runner: Any, batch: int, length: int, iterations: int) -> float:
    """Milliseconds per token step (median of 3 runs of ``iterations`` steps)."""
    import torch

    runs = []
    for _ in range(3):
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        began = time.perf_counter()
        for _ in range(iterations):
            runner.run(batch, length)
            st = engine._batch.state  # the engine's one host read per quantum (here: per token)
            engine._batch.summaries.read(batch, st.produced, st.stepping, st.lengths)
        runs.append(1000 * (time.perf_counter() - began) / iterations)
    return sorted(runs)[1]


def main() -> int:
    """Load the engine, warm it (capturing graphs on CUDA), time every batch bucket, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=256, help="attention length to time at (a bucket's)")
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import torch

    from server.engine.chattts.engine import ChatTTSEngine
    from server.engine.chattts.options import EngineOptions
    from server.engine.chattts.step.graphs import EagerRunner
    from server.engine.chattts.step.kv import bucket_for

    began = time.perf_counter()
    engine = ChatTTSEngine.load(
        model_dir=args.model_dir,
        device=args.device,
        dtype=args.dtype,
        options=EngineOptions(max_batch=args.max_batch),
    )
    load_s = time.perf_counter() - began
    began = time.perf_counter()
    engine.warmup()
    warmup_s = time.perf_counter() - began
    length = bucket_for(engine._batch.length_buckets, min(args.length, engine.max_len))
    runners = {"eager": EagerRunner(engine._batch.token_step)}
    if engine._batch.runner.kind == "cuda-graphs":
        runners["graphs"] = engine._batch.runner
    rows = []
    with torch.inference_mode():
        for batch in engine._batch.batch_buckets:
            row: dict[str, Any] = {"batch": batch, "length": length}
            for name, runner in runners.items():
                ms = time_runner(engine, runner, batch, length, args.iterations)
                row[f"{name}_ms"] = ms
                row[f"{name}_ms_per_row"] = ms / batch
            rows.append(row)
            print(
                f"[gpu_step] batch {batch}: "
                + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("_ms")),
                flush=True,
            )
    result = {
        "device": str(engine.device),
        "dtype": engine.info.extra["dtype"],
        "extra": dict(engine.info.extra),
        "load_s": load_s,
        "warmup_s": warmup_s,
        "graph_misses": getattr(engine._batch.runner, "misses", None),
        "memory_allocated": engine.memory_allocated(),
        "rows": rows,
    }
    engine.close()
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
