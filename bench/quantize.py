"""What ``--quantize int8`` costs in fidelity: code agreement with float32 over the same prompts.

Usage::

    python -m bench.quantize --model-dir /tmp/dev-full --threads 2 --out bench/results/quantize_cpu

Random weights allow no listening test, so fidelity is measured as ChatTTS's own
reference would be: the same seeded requests (default sampling: temperature 0.3, top-p
0.7, top-k 20; EOS banned, so every run has ``--tokens`` tokens) through an engine in each
configuration, compared with float32's codes (float32 is token-identical to ChatTTS's
``infer()``): the first step whose codes differ, and the share of (token, code stream)
positions that hold float32's code. A sampled sequence that left float32's path once goes
its own way (each token depends on the ones before), so the share falls with the first
difference; bf16 alone is the yardstick a user already accepts with ``--dtype auto``.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import torch

from bench.dtype import TEXTS, codes_of, first_divergence
from bench.engine_bench import command, engine_parser, model_kind, prepare, report_header
from bench.machine import describe_machine
from server.engine.chattts.engine import ChatTTSEngine
from server.engine.chattts.options import EngineOptions

#: name → (dtype, quantize); the first is the reference.
CONFIGS = {
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "bfloat16+int8": ("bfloat16", "int8"),
    "float32+int8": ("float32", "int8"),
}


def codes(model_dir: Path, device: str, config: str, cases: list[tuple[str, int]], tokens: int) -> list[Any]:
    """The codes of every case in one configuration (its engine loaded, used, closed)."""
    dtype, quantize = CONFIGS[config]
    options = EngineOptions(min_tokens=tokens, warmup_prompt_chars=80, quantize=quantize, max_batch=1)
    engine = ChatTTSEngine.load(model_dir=model_dir, device=device, dtype=dtype, options=options)
    try:
        return [codes_of(engine, text, seed, tokens) for text, seed in cases]
    finally:
        engine.close()
        gc.collect()


def main() -> None:
    """Run every configuration over the cases, compare with float32, write JSON and markdown."""
    parser = engine_parser(__doc__)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--cases", type=int, default=8)
    args = parser.parse_args()
    if args.render:
        report = json.loads(args.out.with_suffix(".json").read_text())
        args.out.with_suffix(".md").write_text(render(report))
        return
    prepare(args)
    cases = [(TEXTS[i % len(TEXTS)], 100 + i) for i in range(args.cases)]
    names = ["float32", *[c for c in args.configs.split(",") if c != "float32"]]
    got = {name: codes(args.model_dir, args.device, name, cases, args.tokens) for name in names}
    reference = got["float32"]
    results: dict[str, Any] = {}
    for name in names[1:]:
        agreement = [float((r == o).float().mean()) for r, o in zip(reference, got[name], strict=True)]
        results[name] = {
            "first_divergent_step": [
                first_divergence(r, o) for r, o in zip(reference, got[name], strict=True)
            ],
            "code_agreement": agreement,
            "mean_code_agreement": sum(agreement) / len(agreement),
        }
    report = {
        "command": command("bench.quantize"),
        "machine": describe_machine(),
        "shared_machine": "yes: other jobs ran on the same cores (fidelity does not depend on load)",
        "torch_threads": torch.get_num_threads(),
        "model": model_kind(args.model_dir),
        "tokens": args.tokens,
        "cases": len(cases),
        "sampling": "temperature 0.3, top-p 0.7, top-k 20 (ChatTTS's defaults), seeds 100…",
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(report))
    print(render(report))


def render(report: dict[str, Any]) -> str:
    """The markdown table."""
    lines = [
        *report_header("`--quantize int8`: code agreement with float32", report),
        f"Model: {report['model']}; {report['cases']} seeded requests ({report['sampling']}), "
        f"{report['tokens']} tokens each (EOS banned).",
        "",
        "| configuration | first step differing from float32, per request | share of codes equal to "
        "float32's, per request | mean share |",
        "|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        steps = ", ".join("—" if s is None else str(s) for s in r["first_divergent_step"])
        shares = ", ".join(f"{a:.2f}" for a in r["code_agreement"])
        lines.append(f"| {name} | {steps} | {shares} | {r['mean_code_agreement']:.3f} |")
    lines += ["", "`—`: identical to float32 for all tokens."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
