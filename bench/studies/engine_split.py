"""Where the engine's time goes in a closed loop: token steps, audio decode, prefill, the rest.

``python -m bench.studies.engine_split --model-dir DIR --compile-step on --quantize w8a8 \\
    --concurrency 1,8 --duration 40 --max-audio-s 6 --threads 2 \\
    --out bench/results/studies/engine-split-<hw>``

The engine stepped in-process exactly as :mod:`bench.baselines.engine` steps it (a closed loop of
N jobs, each finished job replaced at once), with three of its calls timed from the outside:
the token step (``runner.run``: one token for every row, compiled, captured or eager, timed
per (batch, attention length) shape), the batched Decoder + Vocos call (``BlockLoop.decode``)
and the prompt prefill (``SlotBatch.prefill``: a step's newcomers together). What is left of
the wall time is the block's bookkeeping, sampling summaries and Python. Nothing is wrapped
inside the compiled step, so the compiled graphs are the ones serving runs. One warm scenario of ``--warm-s``
precedes each measured one (rows at every length, as in steady state).

Writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.baselines.engine import ClosedLoop, add_engine_arguments, closed_loop, load_engine
from bench.harness import inproc
from bench.harness.engine_bench import command, report_header, timed
from bench.harness.machine import describe_machine
from bench.harness.textset import seed_base

PARTS = ("step", "decode", "prefill")


class PartTimer:
    """Seconds spent in the decode and the prefill, and every token step's seconds by shape."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.shapes: dict[tuple[int, int], list[float]] = defaultdict(list)

    def wrap_step(self, run: Callable[[int, int], None]) -> Callable[[int, int], None]:
        """The runner's ``run(batch, length)``, each call's time noted under its shape."""

        def timed_run(batch: int, length: int) -> None:
            began = time.perf_counter()
            try:
                run(batch, length)
            finally:
                self.shapes[(batch, length)].append(time.perf_counter() - began)

        return timed_run

    def take(self) -> tuple[dict[str, float], dict[tuple[int, int], list[float]]]:
        """The parts' seconds (``step``: the sum over the shapes) and the shapes since the last call."""
        shapes = dict(self.shapes)
        seconds = {**self.seconds, "step": sum(sum(times) for times in shapes.values())}
        self.seconds.clear()
        self.shapes.clear()
        return seconds, shapes


def instrument(engine: Any, timer: PartTimer) -> None:
    """Time this engine's token step, decode and prefill (instance attributes: nothing global)."""
    batch = engine._batch
    batch.runner.run = timer.wrap_step(batch.runner.run)
    batch.block.decode = timed(timer.seconds, "decode", batch.block.decode)
    batch.prefill = timed(timer.seconds, "prefill", batch.prefill)  # a step's newcomers, together


def scenario(
    loop: ClosedLoop, timer: PartTimer, concurrency: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One warm scenario, then the measured one: audio per wall-s and the split."""
    loop.run(concurrency, args.warm_s, base_seed=seed_base(args.seed, f"warm{concurrency}"))
    timer.take()
    cpu0 = inproc.cpu_now()
    run = loop.run(concurrency, args.duration, base_seed=seed_base(args.seed, f"c{concurrency}"))
    cpu_s = inproc.cpu_now() - cpu0
    wall = run.t_end - run.t_start
    seconds, shapes = timer.take()
    audio = sum(r.samples for r in run.records) / inproc.SAMPLE_RATE
    parts = {part: seconds.get(part, 0.0) for part in PARTS}
    parts["other"] = max(0.0, wall - sum(parts.values()))
    return {
        "concurrency": concurrency,
        "streams": len(run.records),
        "wall_s": wall,
        "cpu_s": cpu_s,
        "audio_s": audio,
        "audio_per_wall": audio / wall if wall else 0.0,
        "parts_s": parts,
        "steps": [
            {"batch": b, "length": n, "count": len(times), "mean_ms": 1000 * sum(times) / len(times)}
            for (b, n), times in sorted(shapes.items())
        ],
    }


def render(report: dict[str, Any]) -> str:
    """The Markdown report."""
    lines = report_header("Where the engine's closed-loop time goes", report)
    lines += [f"Engine: {report['engine']}", ""]
    lines += ["| streams | audio-s per wall-s | wall s | token steps | audio decode | prefill | other |"]
    lines += ["|---|---|---|---|---|---|---|"]
    for s in report["scenarios"]:
        wall, parts = s["wall_s"], s["parts_s"]
        cells = [f"{parts[p]:.1f} s ({100 * parts[p] / wall:.0f} %)" for p in (*PARTS, "other")]
        lines.append(
            f"| {s['concurrency']} | {s['audio_per_wall']:.2f} | {wall:.1f} | " + " | ".join(cells) + " |"
        )
    for s in report["scenarios"]:
        lines += ["", f"## Token steps at {s['concurrency']} streams, by shape", ""]
        lines += ["| batch | attention length | steps | mean ms |", "|---|---|---|---|"]
        lines += [f"| {t['batch']} | {t['length']} | {t['count']} | {t['mean_ms']:.1f} |" for t in s["steps"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    """Load the engine, run the scenarios, write the report."""
    parser = inproc.base_parser(__doc__ or "")
    add_engine_arguments(parser)
    parser.add_argument("--warm-s", type=float, default=8.0, help="warm scenario before each measured one")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    engine, load_s = load_engine(args)
    timer = PartTimer()
    instrument(engine, timer)
    loop = closed_loop(engine, args)
    scenarios = [scenario(loop, timer, c, args) for c in inproc.concurrencies(args)]
    extra = engine.info.extra
    engine_facts = ", ".join(
        f"{key} {extra.get(key)}"
        for key in ("dtype", "token_step", "projections", "vocoder_dtype", "kv_cache_bytes")
    )
    engine.close()
    out: Path = args.out
    report = {
        "command": command("bench.studies.engine_split"),
        "machine": describe_machine(),
        "torch_threads": torch.get_num_threads(),
        "shared_machine": "not stated (the load average at start says what else ran)",
        "engine": f"{engine_facts}, load and warm-up {load_s:.0f} s",
        "load_s": load_s,
        "scenarios": scenarios,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
