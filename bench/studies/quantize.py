"""What ``--quantize int8`` and ``w8a8`` cost in fidelity: code agreement with float32 over the same prompts.

Usage::

    python -m bench.studies.quantize --model-dir /tmp/dev-full --threads 2 \\
        --out bench/results/studies/quantize-<hw>

Random weights allow no listening test, so fidelity is measured as ChatTTS's own
reference would be: the same seeded requests (default sampling: temperature 0.3, top-p
0.7, top-k 20; EOS banned, so every run has ``--tokens`` tokens) through an engine in each
configuration, compared with float32's codes (float32 is token-identical to ChatTTS's
``infer()``): the first step whose codes differ, and the share of (token, code stream)
positions that hold float32's code. A sampled sequence that left float32's path once goes
its own way (each token depends on the ones before), so that share falls to chance after
the first difference. The telling figure is the **teacher-forced agreement**: every
configuration reads float32's own sequence (its prompt and codes, one prefill) and samples
each next code with the same random draws and the same penalty history; the share of codes
equal to float32's is how often its distribution picks what float32 picked given the same
past. float32 against itself gives the floor of that measure (a prefill's numerics differ
from the step's in the last bits). bf16 alone is the yardstick a user already accepts with
``--dtype auto``.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import torch

from bench.harness.engine_bench import command, engine_parser, model_kind, prepare, report_header
from bench.harness.machine import describe_machine
from bench.studies.dtype import TEXTS, codes_of, first_divergence
from server.engine.chattts.engine import ChatTTSEngine
from server.engine.chattts.options import EngineOptions

#: name → (dtype, quantize); the first is the reference.
CONFIGS = {
    "float32": ("float32", "none"),
    "bfloat16": ("bfloat16", "none"),
    "bfloat16+int8": ("bfloat16", "int8"),
    "float32+int8": ("float32", "int8"),
    "bfloat16+w8a8": ("bfloat16", "w8a8"),
    "float32+w8a8": ("float32", "w8a8"),
}


def load(model_dir: Path, device: str, config: str, tokens: int) -> ChatTTSEngine:
    """An engine in ``config`` (EOS banned for ``tokens``, one slot)."""
    dtype, quantize = CONFIGS[config]
    options = EngineOptions(min_tokens=tokens, warmup_prompt_chars=80, quantize=quantize, max_batch=1)
    return ChatTTSEngine.load(model_dir=model_dir, device=device, dtype=dtype, options=options)


def forced_codes(engine: ChatTTSEngine, text: str, seed: int, reference: torch.Tensor) -> torch.Tensor:
    """Each next code this engine samples after ``reference``'s own past (one prefill of it all).

    The prompt and ``reference``'s codes go through the Llama as one sequence; the hidden
    state before token ``i`` gives its logits, sampled with the engine's chain, the row's
    counter-based draws for token ``i`` and the penalty window of ``reference[:i]``.
    """
    from transformers.cache_utils import DynamicCache

    from server.engine.chattts.step.llama import forward_layers
    from server.engine.chattts.step.sampling import (
        PENALTY_WINDOW,
        RowSampling,
        counter_uniforms,
        sample_codes,
        seed_of,
        stream_key,
    )
    from server.engine_api import SequenceRequest, SynthesisParams

    step, chat = engine._batch.token_step, engine._chat
    request = SequenceRequest(seq_id=1, text=text, params=SynthesisParams(seed=seed))
    row = engine._row(request, engine.text.model_text(text))
    params, (t, q) = request.params, reference.shape
    with torch.inference_mode():
        emb = chat.embed(row.input_ids, row.text_mask)
        chat.speaker.apply(emb, row.speaker, row.input_ids, chat.tokenizer.spk_emb_ids, engine.device)
        streams = torch.arange(q)
        codes_emb = step.code_w[streams, reference[:-1]].sum(dim=1).unsqueeze(0)
        sequence = torch.cat([emb, codes_emb], dim=1)
        positions = torch.arange(sequence.shape[1]).unsqueeze(0)
        out = forward_layers(engine._llama, sequence.to(engine.dtype), positions, DynamicCache(), None)
        hidden = out[0, emb.shape[1] - 1 :].float()  # (t, hidden): the state before each token
        logits = torch.einsum("bh,qvh->bqv", hidden, step.head_w)
        padded = torch.cat([torch.full((PENALTY_WINDOW, q), engine.eos + 1), reference])
        history = torch.stack([padded[i : i + PENALTY_WINDOW] for i in range(t)]).transpose(1, 2)
        k0, k1 = stream_key(seed_of(request))
        uniforms = counter_uniforms(torch.full((t,), k0), torch.full((t,), k1), torch.arange(t), streams)
        sampling = RowSampling(
            temperature=torch.full((t,), params.temperature),
            top_p=torch.full((t,), params.top_p),
            top_k=torch.full((t,), params.top_k),
            suppress_eos=torch.ones(t, dtype=torch.bool),
        )
        return sample_codes(
            logits, history, sampling, uniforms, eos=engine.eos, repetition_penalty=step.repetition_penalty
        )


def codes(
    model_dir: Path, device: str, config: str, cases: list[tuple[str, int]], tokens: int, reference: list[Any]
) -> tuple[list[Any], list[Any]]:
    """Free-running codes of every case, and codes forced along ``reference`` (empty: along its own)."""
    engine = load(model_dir, device, config, tokens)
    try:
        free = [codes_of(engine, text, seed, tokens) for text, seed in cases]
        ref = reference or free
        forced = [forced_codes(engine, text, seed, r) for (text, seed), r in zip(cases, ref, strict=True)]
        return free, forced
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
    reference, _ = codes(args.model_dir, args.device, "float32", cases, args.tokens, [])
    results: dict[str, Any] = {}
    for name in names:
        free, forced = codes(args.model_dir, args.device, name, cases, args.tokens, reference)
        agreement = [float((r == o).float().mean()) for r, o in zip(reference, free, strict=True)]
        teacher = [float((r == o).float().mean()) for r, o in zip(reference, forced, strict=True)]
        results[name] = {
            "first_divergent_step": [first_divergence(r, o) for r, o in zip(reference, free, strict=True)],
            "code_agreement": agreement,
            "mean_code_agreement": sum(agreement) / len(agreement),
            "forced_agreement": teacher,
            "mean_forced_agreement": sum(teacher) / len(teacher),
        }
    report = {
        "command": command("bench.studies.quantize"),
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
        *report_header("`--quantize int8` and `w8a8`: code agreement with float32", report),
        f"Model: {report['model']}; {report['cases']} seeded requests ({report['sampling']}), "
        f"{report['tokens']} tokens each (EOS banned).",
        "",
        "| configuration | teacher-forced: codes equal to float32's (mean; per request) "
        "| free-running: first step differing from float32, per request | free-running: codes equal "
        "(mean) |",
        "|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        steps = ", ".join("—" if s is None else str(s) for s in r["first_divergent_step"])
        forced = ", ".join(f"{a:.3f}" for a in r["forced_agreement"])
        lines.append(
            f"| {name} | **{r['mean_forced_agreement']:.3f}** ({forced}) | {steps} "
            f"| {r['mean_code_agreement']:.3f} |"
        )
    lines += [
        "",
        "`—`: identical to float32 for all tokens. float32's own row is the measure's floor (its",
        "prefill and its step differ in the last bits). Teacher-forced: each configuration samples",
        "every next code after float32's own past, with float32's draws; free-running: each its own",
        "sequence from the same seed (after the first difference the shares are chance).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
