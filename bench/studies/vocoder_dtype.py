"""The engine's decode (Decoder + Vocos) per ``--vocoder-dtype``: its cost and its distance from float32.

``python -m bench.studies.vocoder_dtype --model-dir DIR [--rows 1,8] [--tokens 12,28,36,52] [--out PATH]``

The model's GPT (float32) speaks one sequence of ``--hidden-tokens`` tokens, and its hidden
states are cut into the windows the engine decodes (a first block: 8 + 4 held back; steady
blocks: 16 context + 16 or 32 new + 4 held back). Two :class:`BatchVocoder` over copies of the
same Decoder and Vocos, one float32 and one bfloat16 (what ``--vocoder-dtype auto`` runs beside
a bf16 GPT), decode the same windows ``rows`` at a time, in interleaved rounds (the median
counts); fidelity is each window's SNR of the bfloat16 samples against the float32 ones.
Random weights: the SNR is a proxy, real weights were never measured here.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.harness.machine import describe_machine, result_stem


def spoken_hiddens(model_dir: Path, tokens: int) -> tuple[Any, Any, torch.Tensor]:
    """The model's float32 Decoder and Vocos, and ``(tokens, hidden)`` GPT hidden states of one sequence."""
    from server.engine.chattts.engine import ChatTTSEngine
    from server.engine.chattts.options import EngineOptions
    from server.engine_api import SequenceRequest, SynthesisParams

    options = EngineOptions(min_tokens=tokens, max_batch=1, vocoder_dtype="float32")
    engine = ChatTTSEngine.load(model_dir=model_dir, device="cpu", dtype="float32", options=options)
    parts: list[torch.Tensor] = []
    engine.token_tap = lambda _seq, _codes, hiddens: parts.append(hiddens)
    text = "The decode's cost and its fidelity, measured on the hidden states the model produced."
    engine.add(SequenceRequest(seq_id=1, text=text, params=SynthesisParams(seed=1), max_tokens=tokens))
    while not engine.step([1])[0].finished:
        pass
    decoder, vocos = engine._chat.decoder, engine._chat.vocos  # close() lets go of the Chat
    engine.close()
    return decoder, vocos, torch.cat(parts)[:tokens].float()


def windows_of(hiddens: torch.Tensor, length: int, rows: int) -> list[torch.Tensor]:
    """``rows`` windows of ``length`` tokens from different places of the sequence."""
    last = int(hiddens.shape[0]) - length
    starts = np.linspace(0, max(0, last), rows).astype(int)
    return [hiddens[s : s + length] for s in starts]


def snr_db(reference: np.ndarray, other: np.ndarray) -> float:
    """``other``'s signal-to-noise ratio against ``reference``, dB."""
    noise = float(np.sum((other - reference) ** 2))
    return float("inf") if noise == 0 else 10.0 * float(np.log10(np.sum(reference**2) / noise))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every (rows, tokens) case: median ms per call of each dtype, and the SNR of bfloat16."""
    from server.engine.chattts.vocode import BatchVocoder

    torch.set_num_threads(args.threads)
    decoder, vocos, hiddens = spoken_hiddens(args.model_dir, args.hidden_tokens)
    vocoders = {
        name: BatchVocoder(copy.deepcopy(decoder), copy.deepcopy(vocos), dtype=dtype)
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
    }
    cases = []
    with torch.inference_mode():
        for rows in args.rows:
            for tokens in args.tokens:
                windows = windows_of(hiddens, tokens, rows)
                times: dict[str, list[float]] = {name: [] for name in vocoders}
                wavs = {name: v.decode(windows) for name, v in vocoders.items()}  # also the warm-up
                for _ in range(args.rounds):
                    for name, vocoder in vocoders.items():
                        began = time.perf_counter()
                        vocoder.decode(windows)
                        times[name].append(1000.0 * (time.perf_counter() - began))
                snrs = [snr_db(r, b) for r, b in zip(wavs["float32"], wavs["bfloat16"], strict=True)]
                ms = {name: statistics.median(t) for name, t in times.items()}
                cases.append(
                    {
                        "rows": rows,
                        "tokens": tokens,
                        "ms": ms,
                        "ms_all": times,
                        "speedup": ms["float32"] / ms["bfloat16"],
                        "snr_db_min": min(snrs),
                        "snr_db_median": statistics.median(snrs),
                    }
                )
                print(f"rows {rows} tokens {tokens}: {ms} snr {min(snrs):.1f} dB", flush=True)
    return {"cases": cases}


def report(result: dict[str, Any]) -> str:
    """The Markdown table."""
    lines = [
        "# The decode per `--vocoder-dtype` (issue #23)",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {result['machine']['cpu_model']} ({result['machine']['cpu_cores']} cores), "
        f"torch {result['machine']['versions']['torch']}, {result['threads']} threads, load average at "
        f"start {result['machine']['loadavg_at_start']}. Random-weight model: the SNR is a proxy.",
        "",
        "| rows | window tokens | float32 ms | bfloat16 ms | speed-up | bf16 SNR vs f32, min / median (dB) |",
        "|---|---|---|---|---|---|",
    ]
    for c in result["cases"]:
        lines.append(
            f"| {c['rows']} | {c['tokens']} | {c['ms']['float32']:.1f} | {c['ms']['bfloat16']:.1f} | "
            f"{c['speedup']:.2f}× | {c['snr_db_min']:.1f} / {c['snr_db_median']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    """Measure and write ``--out``.json and .md."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    parser.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[12, 28, 36, 52])
    parser.add_argument("--hidden-tokens", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=result_stem("studies", "vocoder-dtype"))
    args = parser.parse_args()
    command = "python -m bench.studies.vocoder_dtype " + " ".join(sys.argv[1:])
    machine = describe_machine()
    result = {"command": command, "machine": machine, "threads": args.threads, **measure(args)}
    result["machine"]["loadavg_now"] = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
