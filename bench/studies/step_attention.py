"""The compiled w8a8 step with one row: the dense attention against the C++ operator (issue #46).

``python -m bench.studies.step_attention --model-dir DIR --threads 2 --rounds 12 \\
    --out bench/results/studies/step-attention-<hw>``

Until this study the compiled CPU step attended one row in the dense form
(:func:`~server.engine.chattts.step.llama.math_attention`, which inductor fuses with what
precedes it) and batches through ``chattts_stream::decode_attention``
(:mod:`server.engine.chattts.step.decode_attention`). A profile of the batch-1 step showed
the fusion's price: inductor turned the query by the rotary embedding inside the attention's
loop over key positions, a cosine and a sine per element of every position. This study builds
the default's step (``--compile-step ahead --quantize w8a8``, full-size model) twice in one
process, once under each rule, and times them round by round, interleaved (order flipped every
round), at batch 1 and batch 8 over ``--length`` positions: the median of three runs of
``--iterations`` calls each round. Batch 8 is the same code under both rules (a control).

Writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import torch

from bench.cpu.rig import bf16_cpu_engine, fill_slots, median_ms
from bench.harness.engine_bench import command, engine_parser, model_kind, prepare, report_header
from bench.harness.machine import describe_machine
from server.engine.chattts.step import decode_attention
from server.engine.chattts.step.llama import math_attention

BATCHES = (1, 8)


def dense_for_one_row(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """The rule before: the dense form for one row, the operator for a batch."""
    if q.shape[0] == 1:
        return math_attention(q, keys, values, mask, scale)
    return decode_attention.decode_attention(q, keys, values, mask, scale)


RULES = {
    "dense at batch 1 (before)": dense_for_one_row,
    "the operator (now)": decode_attention.step_attention,
}


def build(rule: str, model_dir: Any, length: int) -> Any:
    """A fresh engine whose step attends by ``rule``, compiled ahead at both batches."""
    default = decode_attention.step_attention
    decode_attention.step_attention = RULES[rule]  # read once, when the engine builds its step
    try:
        engine = bf16_cpu_engine(
            model_dir, max_batch=max(BATCHES), compile_step=True, compile_ahead=True, quantize="w8a8"
        )
    finally:
        decode_attention.step_attention = default
    batch = engine._batch
    with torch.inference_mode():
        fill_slots(engine, max(BATCHES), length)
        batch.prepare_runner([(b, length) for b in BATCHES])
    if batch.runner_fallback is not None:
        raise RuntimeError(f"{rule}: {batch.runner_fallback}")
    return batch


def measure(args: Any) -> dict[str, Any]:
    """Both rules' step times, per batch, every round."""
    runners = {rule: build(rule, args.model_dir, args.length) for rule in RULES}
    rounds: dict[str, dict[int, list[float]]] = {rule: {b: [] for b in BATCHES} for rule in RULES}
    with torch.inference_mode():
        for r in range(args.rounds):
            for rule in list(RULES) if r % 2 == 0 else list(RULES)[::-1]:
                for b in BATCHES:
                    wall, _ = median_ms(
                        lambda b=b, rule=rule: runners[rule].runner.run(b, args.length), args.iterations
                    )
                    rounds[rule][b].append(wall)
            latest = {rule: [per[b][-1] for b in BATCHES] for rule, per in rounds.items()}
            print(f"[step_attention] round {r}: {json.dumps(latest)}", flush=True)
    summary = {
        rule: {
            str(b): {"min_ms": min(v), "median_ms": statistics.median(v), "rounds_ms": v}
            for b, v in per.items()
        }
        for rule, per in rounds.items()
    }
    before, now = (summary[rule] for rule in RULES)
    ratios = {str(b): now[str(b)]["median_ms"] / before[str(b)]["median_ms"] for b in BATCHES}
    return {"rules": summary, "now_over_before": ratios}


def render(report: dict[str, Any]) -> str:
    """The Markdown result."""
    lines = report_header(
        "The compiled w8a8 step: one row's attention dense or through the C++ operator", report
    )
    cfg = report["config"]
    lines += [
        f"Model: {cfg['model']}; `--compile-step ahead --quantize w8a8`, {cfg['length']} positions, "
        f"{cfg['rounds']} interleaved rounds of {cfg['iterations']} calls (each round's figure the "
        "median of three runs).",
        "",
        "| rule | batch 1 min ms | batch 1 median ms | batch 8 min ms | batch 8 median ms |",
        "|---|---|---|---|---|",
    ]
    for rule, per in report["rules"].items():
        one, eight = per["1"], per["8"]
        lines.append(
            f"| {rule} | {one['min_ms']:.2f} | {one['median_ms']:.2f} "
            f"| {eight['min_ms']:.2f} | {eight['median_ms']:.2f} |"
        )
    ratio = report["now_over_before"]
    lines += [
        "",
        f"Now over before, medians: batch 1 **{ratio['1']:.3f}×**, batch 8 {ratio['8']:.3f}× "
        "(the same code under both rules: the machine's noise).",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    """Measure, write ``OUT.json`` and ``OUT.md``."""
    parser = engine_parser(__doc__)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--shared", default="no: nothing else ran", help="what else ran on the machine")
    args = parser.parse_args()
    if args.render:
        report = json.loads(args.out.with_suffix(".json").read_text())
        args.out.with_suffix(".md").write_text(render(report))
        return 0
    prepare(args)
    began = time.perf_counter()
    report: dict[str, Any] = {
        "command": command("bench.studies.step_attention"),
        "machine": describe_machine(),
        "torch_threads": torch.get_num_threads(),
        "shared_machine": args.shared,
        "config": {
            "model": model_kind(args.model_dir),
            "length": args.length,
            "rounds": args.rounds,
            "iterations": args.iterations,
        },
    }
    report.update(measure(args))
    report["elapsed_s"] = time.perf_counter() - began
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
