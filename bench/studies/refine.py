"""What ``refine: true`` adds to the time to first audio: refinement off vs on, one process.

Usage:
    python -m bench.studies.refine --model-dir /tmp/devfull --threads 2 \\
        --out bench/results/studies/refine-<hw>
    python -m bench.studies.refine --model-dir DIR --device cuda --batches 1,8 \\
        --out bench/results/studies/refine-<gpu>

(``/tmp/devfull``: ``chattts-stream make-dev-model --size full /tmp/devfull``; or pass
``--make-model`` to write it when missing.)

One engine (``--refine-max-tokens`` = the largest of ``--refine-tokens``), stepped exactly as
the server steps it: ``B`` sequences added at once, then engine steps until each has its first
audio. Time to first audio (TTFA) of each sequence counts from its ``add`` (the moment the
scheduler hands it over) to the end of the step that returned its first samples; the server's
own overhead (sockets, encoding) comes on top, equally with and without refinement.

The modes run interleaved: every round runs refinement off and on at each token cap, back to
back, in rotating order, so load from other jobs on a shared machine falls on all of them
alike; the result is the median over rounds of the *paired* difference (on − off in the same
round). Random weights never end a refinement early (end-of-text is one token among ~21k), so
each refinement runs to its cap: the figures are the cost of that many refinement tokens. Real
weights stop when the rewrite is done, at about the length of the input text plus its tags.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench.harness.engine_bench import command, engine_parser, model_kind, prepare, report_header
from bench.harness.machine import describe_machine
from bench.studies.dtype import TEXTS
from server.engine.chattts.engine import ChatTTSEngine
from server.engine.chattts.options import EngineOptions
from server.engine.chattts.refine import RefineJob, RefineParams, Refiner, RefineRow, TextRefineJob
from server.engine_api import SequenceRequest, SynthesisParams

#: Audio tokens each sequence is allowed (only its first block is waited for).
SPEECH_TOKENS = 64


class CountingRefiner:
    """The engine's refiner, recording how many tokens each refined row generated."""

    def __init__(self, inner: Refiner) -> None:
        self.inner = inner
        self.jobs: list[RefineJob] = []

    def start(self, rows: Sequence[RefineRow], params: RefineParams) -> RefineJob:
        job = self.inner.start(rows, params)
        self.jobs.append(job)
        return job

    def take_tokens(self) -> list[int]:
        """Tokens generated per row by the jobs started since the last call."""
        counts = [len(ids) for job in self.jobs if isinstance(job, TextRefineJob) for ids in job.ids()]
        self.jobs.clear()
        return counts


def load(args: argparse.Namespace, cap: int) -> ChatTTSEngine:
    engine = ChatTTSEngine.load(
        model_dir=args.model_dir,
        device=args.device,
        dtype=args.dtype,
        options=EngineOptions(
            min_tokens=SPEECH_TOKENS,  # random weights may end a sequence at once: keep every first block
            refine_max_tokens=cap,
            warmup_prompt_chars=80,
            max_batch=max(args.batches_list),
        ),
    )
    engine.warmup()
    return engine


def first_audio(engine: ChatTTSEngine, batch: int, refine_tokens: int, seq_base: int) -> list[float]:
    """Add ``batch`` sequences at once; seconds from the ``add`` to each one's first audio.

    ``refine_tokens`` 0: no refinement; otherwise each is refined with at most that many tokens.
    """
    if refine_tokens:
        engine.refine_params = RefineParams(max_new_tokens=refine_tokens)
    ids = [seq_base + i for i in range(batch)]
    t0 = time.perf_counter()
    for i, seq_id in enumerate(ids):
        params = SynthesisParams(seed=seq_id, refine=refine_tokens > 0)
        engine.add(
            SequenceRequest(
                seq_id=seq_id, text=TEXTS[i % len(TEXTS)], params=params, max_tokens=SPEECH_TOKENS
            )
        )
    ttfa: dict[int, float] = {}
    try:
        while len(ttfa) < batch:
            results = engine.step([s for s in ids if s not in ttfa])
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter() - t0
            ttfa.update((r.seq_id, now) for r in results if r.audio.size and r.seq_id not in ttfa)
    finally:
        for seq_id in ids:
            engine.drop(seq_id)
    return [ttfa[s] for s in ids]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    caps = args.refine_tokens_list
    engine = load(args, max(caps))
    counter = CountingRefiner(engine.refiner)
    engine.refiner = counter
    modes = [0, *caps]  # 0: refinement off
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        str(b): {str(m): [] for m in modes} for b in args.batches_list
    }
    seq = 1
    try:
        for r in range(args.rounds):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            for batch in args.batches_list:
                for mode in order:
                    ttfa = first_audio(engine, batch, mode, seq_base=seq)
                    seq += batch
                    tokens = counter.take_tokens()
                    runs[str(batch)][str(mode)].append({"round": r, "ttfa_s": ttfa, "refine_tokens": tokens})
                    print(f"round {r} batch {batch} refine {mode}: ttfa {ttfa} tokens {tokens}", flush=True)
    finally:
        engine.close()
    blocks = ",".join(str(b) for b in engine.block_schedule)
    return {"engine": engine.info.extra, "block_schedule": blocks, "runs": runs, "modes": modes}


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]], modes: list[int]) -> dict[str, Any]:
    """Per batch and mode: median TTFA, and the median paired difference to refinement off."""
    out: dict[str, Any] = {}
    for batch, by_mode in runs.items():
        off = [statistics.mean(run["ttfa_s"]) for run in by_mode["0"]]
        rows: dict[str, Any] = {}
        for mode in modes:
            mean_ttfa = [statistics.mean(run["ttfa_s"]) for run in by_mode[str(mode)]]
            row: dict[str, Any] = {"median_ttfa_s": statistics.median(mean_ttfa)}
            if mode:
                added = [on - base for on, base in zip(mean_ttfa, off, strict=True)]
                tokens = [t for run in by_mode[str(mode)] for t in run["refine_tokens"]]
                row |= {
                    "added_s_per_round": added,
                    "median_added_s": statistics.median(added),
                    "median_refine_tokens": statistics.median(tokens),
                    "ms_per_refine_token": 1000 * statistics.median(added) / statistics.median(tokens),
                }
            rows[str(mode)] = row
        out[batch] = rows
    return out


def render(report: dict[str, Any]) -> str:
    eng = report["engine"]
    lines = [
        *report_header("`refine: true`: what refinement adds to the time to first audio", report),
        f"Model: {report['model']}, on {eng.get('device')} in {eng.get('dtype')}; block schedule "
        f"{report['block_schedule']} (a refinement advances by the largest block per engine step).",
        "",
        "TTFA: from adding the sequences to the engine to the end of the step that returned each one's",
        "first audio (the mean over the batch's sequences); each round runs every mode back to back, so",
        "*added* is the paired difference to refinement off in the same round; medians over rounds.",
        "Random weights run every refinement to its cap, so the cap is the number of tokens refined.",
        "",
        "| batch | refinement (token cap) | TTFA (median) | added, per round | added (median) "
        "| tokens refined (median) | ms per refinement token (median / best round) |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch, rows in report["summary"].items():
        for mode, row in rows.items():
            ttfa = f"{row['median_ttfa_s']:.3f} s"
            if mode == "0":
                lines.append(f"| {batch} | off | {ttfa} | — | — | — | — |")
                continue
            per_round = " ".join(f"{a:.2f}" for a in row["added_s_per_round"])
            best = 1000 * min(row["added_s_per_round"]) / row["median_refine_tokens"]
            lines.append(
                f"| {batch} | on ({mode}) | {ttfa} | {per_round} | {row['median_added_s']:.2f} s "
                f"| {row['median_refine_tokens']:g} | {row['ms_per_refine_token']:.1f} / {best:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = engine_parser(__doc__)
    parser.add_argument("--dtype", default="auto", help="the server's --dtype (default auto, as the server)")
    parser.add_argument("--refine-tokens", default="96,384", help="refinement token caps to measure")
    parser.add_argument("--batches", default="1", help="sequences added at once, e.g. 1,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--shared",
        default="yes: other jobs ran on the same cores; differences come from interleaved rounds",
        help="what else ran on the machine (written into the result)",
    )
    args = parser.parse_args()
    if args.render:
        report = json.loads(args.out.with_suffix(".json").read_text())
        args.out.with_suffix(".md").write_text(render(report))
        return
    args.refine_tokens_list = [int(t) for t in args.refine_tokens.split(",")]
    args.batches_list = [int(b) for b in args.batches.split(",")]
    if min(args.refine_tokens_list) < 1 or min(args.batches_list) < 1:
        parser.error("--refine-tokens and --batches take positive integers")
    prepare(args)
    machine = describe_machine()
    measured = measure(args)
    report = {
        "command": command("bench.studies.refine"),
        "machine": machine,
        "shared_machine": args.shared,
        "torch_threads": torch.get_num_threads(),
        "model": model_kind(args.model_dir),
        "engine": measured["engine"],
        "block_schedule": measured["block_schedule"],
        "speech_tokens": SPEECH_TOKENS,
        "runs": measured["runs"],
        "summary": summarize(measured["runs"], measured["modes"]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(render(report))
    print(render(report))


if __name__ == "__main__":
    main()
