"""What each ``--dtype`` costs and buys: float32 vs bfloat16 (vs float16 on CUDA), one process.

Usage:
    python -m bench.studies.dtype --model-dir /tmp/devfull --threads 2 --out bench/results/studies/dtype-<hw>
    python -m bench.studies.dtype --model-dir DIR --device cuda --dtypes float32,bfloat16,float16 \
        --batches 1,8,32 --out bench/results/studies/dtype-<gpu>

(``/tmp/devfull``: ``chattts-stream make-dev-model --size full /tmp/devfull``; or pass
``--make-model`` to write it when missing.)

Two measurements on the same weights, each dtype an engine of its own in this process:

* throughput: ``B`` sequences forced to ``--tokens`` audio tokens each (EOS banned), stepped
  through the engine exactly as the server does (prefill, token blocks, incremental decode).
  Audio seconds per wall second and per CPU second of this process (all threads). The dtypes
  run interleaved, round after round, in alternating order, so that load from other jobs on a
  shared machine falls on all of them alike; the medians over rounds are reported.
* fidelity: the same seeded request (default sampling: temperature 0.3, top-p 0.7, top-k 20)
  in each dtype; the first step whose codes differ from float32's (``None``: equal for all
  ``--fidelity-tokens``). float32 is the reference because it is token-identical to ChatTTS's
  own ``infer()`` (tests/model/test_native_equivalence.py).
"""

from __future__ import annotations

import argparse
import gc
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

SAMPLES_PER_TOKEN = 512
RATE = 24_000
TEXTS = (
    "Streaming speech should start quickly and never click between chunks.",
    "你好，欢迎使用实时语音合成服务，今天的天气很好。",
    "会议在下午三点开始，meeting room B，请准时参加。",
    "The quick brown fox jumps over the lazy dog, twice.",
)


def load(model_dir: Path, device: str, dtype: str, tokens: int) -> ChatTTSEngine:
    options = EngineOptions(min_tokens=tokens, warmup_prompt_chars=80)
    engine = ChatTTSEngine.load(model_dir=model_dir, device=device, dtype=dtype, options=options)
    engine.warmup()
    return engine


def throughput(engine: ChatTTSEngine, batch: int, tokens: int, base_id: int) -> dict[str, float]:
    """Run ``batch`` forced-length sequences to the end; wall and CPU seconds, audio seconds."""
    ids = [base_id + i for i in range(batch)]
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for i, seq_id in enumerate(ids):
        text = TEXTS[i % len(TEXTS)]
        engine.add(
            SequenceRequest(seq_id=seq_id, text=text, params=SynthesisParams(seed=i), max_tokens=tokens)
        )
    produced = 0
    live = list(ids)
    while live:
        for result in engine.step(live):
            produced += result.tokens
            if result.finished:
                live.remove(result.seq_id)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    audio = produced * SAMPLES_PER_TOKEN / RATE
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "audio_s": audio,
        "rtf_wall": audio / wall,
        "audio_per_cpu_s": audio / cpu,
    }


def codes_of(engine: ChatTTSEngine, text: str, seed: int, tokens: int) -> torch.Tensor:
    got: list[torch.Tensor] = []
    engine.token_tap = lambda _sid, codes, _hidden: got.append(codes)
    try:
        engine.add(SequenceRequest(seq_id=1, text=text, params=SynthesisParams(seed=seed), max_tokens=tokens))
        while True:
            [result] = engine.step([1])
            if result.finished:
                break
    finally:
        engine.token_tap = None
    return torch.cat(got)


def first_divergence(reference: torch.Tensor, other: torch.Tensor) -> int | None:
    n = min(len(reference), len(other))
    differ = (reference[:n] != other[:n]).any(dim=1).nonzero().flatten().tolist()
    if differ:
        return int(differ[0])
    return None if len(reference) == len(other) else n


def main() -> None:
    parser = engine_parser(__doc__)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fidelity-tokens", type=int, default=96)
    parser.add_argument("--fidelity-cases", type=int, default=8)
    args = parser.parse_args()
    if args.render:
        report = json.loads(args.out.with_suffix(".json").read_text())
        dtypes = list(report["throughput"])
        batches = [int(b) for b in report["throughput"][dtypes[0]]]
        args.out.with_suffix(".md").write_text(render(report, dtypes, batches))
        return
    prepare(args)
    dtypes = args.dtypes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    tokens = args.tokens
    engines = {d: load(args.model_dir, args.device, d, tokens) for d in dtypes}
    runs: dict[str, dict[int, list[dict[str, float]]]] = {d: {b: [] for b in batches} for d in dtypes}
    for r in range(args.rounds):
        order = dtypes if r % 2 == 0 else dtypes[::-1]
        for batch in batches:
            for d in order:
                result = throughput(engines[d], batch, tokens, base_id=1000 * (r + 1))
                runs[d][batch].append(result)
                print(f"round {r} batch {batch} {d}: {result}", flush=True)
    for engine in engines.values():
        engine.close()
    del engines
    gc.collect()
    fidelity = measure_fidelity(args, dtypes)
    report = {
        "command": command("bench.studies.dtype"),
        "machine": describe_machine(),
        "shared_machine": "yes: other jobs ran on the same cores; ratios come from interleaved rounds",
        "torch_threads": torch.get_num_threads(),
        "tokens_per_sequence": tokens,
        "model": model_kind(args.model_dir),
        "throughput": {
            d: {
                str(b): {
                    "runs": runs[d][b],
                    "median_rtf_wall": statistics.median(x["rtf_wall"] for x in runs[d][b]),
                    "median_audio_per_cpu_s": statistics.median(x["audio_per_cpu_s"] for x in runs[d][b]),
                }
                for b in batches
            }
            for d in dtypes
        },
        "fidelity": fidelity,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(report, dtypes, batches))
    print(render(report, dtypes, batches))


def measure_fidelity(args: argparse.Namespace, dtypes: list[str]) -> dict[str, Any]:
    """First differing step against float32, per dtype, over seeded cases (one engine at a time)."""
    n = args.fidelity_tokens
    cases = [(TEXTS[i % len(TEXTS)], 100 + i) for i in range(args.fidelity_cases)]
    codes: dict[str, list[torch.Tensor]] = {}
    for d in ["float32", *[x for x in dtypes if x != "float32"]]:
        engine = load(args.model_dir, args.device, d, n)
        codes[d] = [codes_of(engine, text, seed, n) for text, seed in cases]
        engine.close()
        gc.collect()
    out: dict[str, Any] = {
        "tokens": n,
        "cases": len(cases),
        "sampling": "temperature 0.3, top-p 0.7, top-k 20",
    }
    for d in dtypes:
        if d == "float32":
            continue
        steps = [first_divergence(ref, other) for ref, other in zip(codes["float32"], codes[d], strict=True)]
        out[d] = {"first_divergent_step": steps}
    return out


def render(report: dict[str, Any], dtypes: list[str], batches: list[int]) -> str:
    lines = [
        *report_header("`--dtype`: speed and fidelity", report),
        f"Model: {report['model']}; {report['tokens_per_sequence']} audio tokens "
        "per sequence (EOS banned), prefill + token blocks + incremental decode as the server runs them.",
        "",
        "Each round runs every dtype back to back (alternating which goes first), so the ratio of a",
        "dtype to float32 *within a round* compares runs under the same load; the medians of those",
        "paired ratios are the result. Absolute figures swing with the other jobs on the machine.",
        "",
        "| batch | dtype | audio-s per wall-s (median) | audio-s per CPU-s (median) "
        "| ×float32 wall, per round | ×float32 CPU, per round | median × (wall / CPU) |",
        "|---|---|---|---|---|---|---|",
    ]
    tp = report["throughput"]
    for b in batches:
        for d in dtypes:
            row = tp[d][str(b)]
            wall, cpu = row["median_rtf_wall"], row["median_audio_per_cpu_s"]
            ratios = ["—", "—", "—"]
            if "float32" in tp and d != "float32":
                base = tp["float32"][str(b)]["runs"]
                pairs = list(zip(row["runs"], base, strict=True))
                w = [x["rtf_wall"] / y["rtf_wall"] for x, y in pairs]
                c = [x["audio_per_cpu_s"] / y["audio_per_cpu_s"] for x, y in pairs]
                ratios = [
                    " ".join(f"{r:.2f}" for r in w),
                    " ".join(f"{r:.2f}" for r in c),
                    f"{statistics.median(w):.2f}× / {statistics.median(c):.2f}×",
                ]
            lines.append(f"| {b} | {d} | {wall:.3f} | {cpu:.3f} | {' | '.join(ratios)} |")
    fid = report["fidelity"]
    lines += [
        "",
        f"Fidelity: {fid['cases']} seeded requests ({fid['sampling']}), {fid['tokens']} tokens each; "
        "first step whose codes differ from float32's (`None`: identical throughout):",
        "",
    ]
    for d in dtypes:
        if d in fid:
            lines.append(f"- {d}: {fid[d]['first_divergent_step']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
