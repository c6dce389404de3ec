"""How many graphs the compiled CPU step traces, with and without the KV slots' spare position (issue #46).

``python -m bench.cpu.graphs --model-dir TINY --out bench/results/cpu/graphs-<hw>``

Each graph is traced again at every start (dynamo, AOTAutograd, freezing: minutes on two
cores), so fewer graphs is a faster cold start and a faster restart. This traces the w8a8
bf16 step (``--compile-step on --quantize w8a8``: the CPU's default) at warm-up's shapes
(:func:`server.engine.chattts.step.compiled.compile_order`) under a tracing-only backend
(``aot_eager``: dynamo and AOTAutograd, no inductor, so seconds instead of minutes), then runs
every bucket shape refusing recompiles; once with one spare KV position
(:data:`server.engine.chattts.step.runner.SPARE_POSITIONS`) and once without, each in a fresh
process. Per run: the graphs after each warm-up shape, the shapes that would still compile,
and the guards that failed (``TORCH_LOGS=recompiles``: why a new graph was traced).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.machine import describe_machine

GUARD = re.compile(r"- \d+/\d+: (.+?)  # (.*)$")


def trace(model_dir: Path, backend: str, max_batch: int, spare: int) -> dict[str, Any]:
    """In this process: trace the step at warm-up's shapes; the graph count after each."""
    import torch
    from torch._dynamo.utils import counters

    import server.engine.chattts.step.runner as runner_module
    from server.engine.chattts.assets import load_chat
    from server.engine.chattts.engine import ChatTTSEngine
    from server.engine.chattts.options import EngineOptions
    from server.engine.chattts.step.compiled import compile_order

    runner_module.SPARE_POSITIONS = spare  # read when the slots are made
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    options = EngineOptions(max_batch=max_batch, quantize="w8a8", compile_step=True)
    engine = ChatTTSEngine(
        load_chat(model_dir=model_dir, device=cpu), device=cpu, dtype=torch.bfloat16, options=options
    )
    step = engine._batch.runner._step  # the static step the runner would compile

    def token_step(batch: int, length: int) -> None:
        step(batch, length)

    compiled = torch.compile(token_step, backend=backend, dynamic=True)
    order: list[dict[str, Any]] = []
    shapes = engine._batch.shapes()
    missing = []
    with torch.inference_mode():
        for batch, length in compile_order(shapes):
            began = time.perf_counter()
            compiled(batch, length)
            graphs = counters["stats"]["unique_graphs"]
            order.append(
                {"shape": f"{batch}x{length}", "s": round(time.perf_counter() - began, 1), "graphs": graphs}
            )
        with torch.compiler.set_stance("fail_on_recompile"):
            for batch, length in shapes:
                try:
                    compiled(batch, length)
                except RuntimeError:
                    missing.append(f"{batch}x{length}")
    return {
        "spare_positions": spare,
        "kv_positions": int(engine._batch.kv.keys[0].shape[2]),
        "longest_length": max(engine._batch.length_buckets),
        "order": order,
        "graphs": counters["stats"]["unique_graphs"],
        "shapes_that_would_compile": missing,
    }


def one_process(model_dir: Path, backend: str, max_batch: int, spare: int) -> dict[str, Any]:
    """:func:`trace` in a fresh process (dynamo's caches and counters are per process), with its guards."""
    env = {**os.environ, "TORCH_LOGS": "recompiles"}
    command = [sys.executable, "-m", "bench.cpu.graphs", "--model-dir", str(model_dir), "--backend", backend]
    command += ["--max-batch", str(max_batch), "--child", str(spare)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"trace failed ({run.returncode}): {run.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(run.stdout.splitlines()[-1])
    guards = [m.groups() for line in run.stderr.splitlines() if (m := GUARD.search(line))]
    result["failed_guards"] = sorted({f"{guard}  # {where.strip()}" for guard, where in guards})
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--backend", default="aot_eager", help="torch.compile backend (aot_eager, eager)")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--out", type=Path, help="path stem: writes .json")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # one traced run, its spare positions
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(trace(args.model_dir, args.backend, args.max_batch, args.child)))
        return 0
    if args.out is None:
        parser.error("--out is required")
    runs = {
        f"spare {spare}": one_process(args.model_dir, args.backend, args.max_batch, spare) for spare in (0, 1)
    }
    result = {
        "machine": describe_machine(),
        "backend": args.backend,
        "max_batch": args.max_batch,
        "flags": "--compile-step on --quantize w8a8 --dtype bfloat16",
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({name: (run["graphs"], run["shapes_that_would_compile"]) for name, run in runs.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
