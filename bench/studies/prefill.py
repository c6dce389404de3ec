"""Eight newcomers prefilled one at a time against together (issue #43, item 4).

``python -m bench.studies.prefill --model-dir DIR --threads 2 --rounds 7 \\
    --out bench/results/studies/prefill-<hw>``

The engine's prefill (:mod:`server.engine.chattts.step.prefill`) is timed on eight newcomers
of one step boundary, short and medium texts of ``bench/texts/default.jsonl`` in eight voices:

* ``alone``: each row its own ``SlotBatch.prefill`` call (one row per call, as before the
  batched prefill: staging, embedding, the Llama's layers, the KV and the slot state);
* ``together``: all eight in one call, grouped by prompt bucket into power-of-two calls
  within ``--prefill-tokens``.

The two are interleaved round by round (a shared machine only adds time); min and median per
mode, and the ratio of the medians. One untimed round of each mode warms the shapes measured.

Writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.harness.engine_bench import command, engine_parser, model_kind, prepare, report_header
from bench.harness.machine import describe_machine
from server.engine.chattts.engine import ChatTTSEngine
from server.engine.chattts.options import EngineOptions
from server.engine_api import SequenceRequest, SynthesisParams

TEXTS = Path(__file__).resolve().parents[1] / "texts" / "default.jsonl"
MODES = ("alone", "together")


def texts(n: int) -> list[str]:
    """``n`` short and medium texts, alternating languages as the file lists them."""
    rows = [json.loads(line) for line in TEXTS.read_text(encoding="utf-8").splitlines() if line.strip()]
    chosen = [r["text"] for r in rows if r["size"] in ("short", "medium")]
    return [chosen[i % len(chosen)] for i in range(n)]


def prefill_once(engine: ChatTTSEngine, prompts: list[str], mode: str, first_id: int) -> tuple[float, float]:
    """Add the prompts, prefill them (``mode``), drop them; the prefill's wall and CPU seconds."""
    requests = [
        SequenceRequest(
            seq_id=first_id + i, text=t, params=SynthesisParams(voice=f"seed:{i + 1}", seed=i), max_tokens=8
        )
        for i, t in enumerate(prompts)
    ]
    for r in requests:
        engine.add(r)
    rows = [engine._seqs[r.seq_id] for r in requests]
    try:
        with torch.inference_mode():
            began, cpu = time.perf_counter(), time.process_time()
            if mode == "together":
                engine._batch.prefill(rows)
            else:
                for row in rows:
                    engine._batch.prefill([row])
            return time.perf_counter() - began, time.process_time() - cpu
    finally:
        for r in requests:
            engine.drop(r.seq_id)


def measure(args: Any) -> dict[str, Any]:
    """Load, warm, time ``--rounds`` interleaved rounds."""
    options = EngineOptions(max_batch=max(16, args.rows), prefill_tokens=args.prefill_tokens or None)
    engine = ChatTTSEngine.load(
        model_dir=args.model_dir, device=args.device, dtype=args.dtype, options=options
    )
    try:
        prompts = texts(args.rows)
        for i, t in enumerate(prompts):
            engine.add(
                SequenceRequest(seq_id=10_000 + i, text=t, params=SynthesisParams(voice=f"seed:{i + 1}"))
            )
        plan = engine._batch.prefiller.calls([engine._seqs[10_000 + i] for i in range(len(prompts))])
        rows_plan = [(length, len(members)) for length, members in plan]
        for i in range(len(prompts)):
            engine.drop(10_000 + i)
        for mode in MODES:  # warm: the shapes measured, once each (all of warm-up takes minutes)
            prefill_once(engine, prompts, mode, 500)
        seconds: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
        for round_ in range(args.rounds):
            order = MODES if round_ % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                seconds[mode].append(prefill_once(engine, prompts, mode, 1000 * (round_ + 1)))
        info = engine.info.extra
    finally:
        engine.close()
    result: dict[str, Any] = {"calls": rows_plan, "prefill_tokens": info.get("prefill_tokens"), "modes": {}}
    for mode, pairs in seconds.items():
        entry: dict[str, Any] = {}
        for i, kind in enumerate(("wall", "cpu")):
            values = [pair[i] * 1e3 for pair in pairs]
            entry[kind] = {"min_ms": min(values), "median_ms": statistics.median(values), "rounds_ms": values}
        result["modes"][mode] = entry
    alone, together = result["modes"]["alone"], result["modes"]["together"]
    result["ratios"] = {
        f"{kind} {stat}": alone[kind][f"{stat}_ms"] / together[kind][f"{stat}_ms"]
        for kind in ("wall", "cpu")
        for stat in ("min", "median")
    }
    return result


def render(report: dict[str, Any]) -> str:
    """The Markdown result."""
    lines = report_header("Eight newcomers prefilled one at a time against together", report)
    cfg = report["config"]
    calls = ", ".join(f"{count} × {length}" for length, count in report["calls"])
    lines += [
        f"Model: {cfg['model']}, dtype {cfg['dtype']}, {cfg['rows']} newcomers, {cfg['rounds']} "
        f"interleaved rounds; `--prefill-tokens` {report['prefill_tokens']}. Together the "
        f"newcomers ran as calls of (rows × padded length): {calls}.",
        "",
        "| mode | wall min ms | wall median ms | CPU min ms | CPU median ms |",
        "|---|---|---|---|---|",
    ]
    for mode, m in report["modes"].items():
        wall, cpu = m["wall"], m["cpu"]
        lines.append(
            f"| {mode} | {wall['min_ms']:.1f} | {wall['median_ms']:.1f} | {cpu['min_ms']:.1f} "
            f"| {cpu['median_ms']:.1f} |"
        )
    ratios = ", ".join(f"{value:.2f}× ({name})" for name, value in report["ratios"].items())
    lines += ["", f"One at a time over together: {ratios}. CPU time is both torch threads' (process time)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    """Measure, write ``OUT.json`` and ``OUT.md``."""
    parser = engine_parser(__doc__)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, default=8, help="newcomers of one step boundary")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prefill-tokens", type=int, default=0, help="0: the device's default")
    args = parser.parse_args()
    if args.render:
        report = json.loads(args.out.with_suffix(".json").read_text())
        args.out.with_suffix(".md").write_text(render(report))
        return 0
    prepare(args)
    report: dict[str, Any] = {
        "command": command("bench.studies.prefill"),
        "machine": describe_machine(),
        "torch_threads": torch.get_num_threads(),
        "shared_machine": "yes: three other agents' tests and builds ran beside it",
        "config": {
            "model": model_kind(args.model_dir),
            "dtype": args.dtype,
            "rows": args.rows,
            "rounds": args.rounds,
        },
    }
    report.update(measure(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
