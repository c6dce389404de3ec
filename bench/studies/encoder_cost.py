"""CPU cost per audio-second of every wire format's encoder, side by side (issue #18).

Same method as ``bench/studies/opus_cost.py`` (``make_encoder(...).push`` with 341 ms
engine blocks, then ``finish``; CPU time of the encoding thread; best of
``--repeats``), on the speech-like signal, for pcm16, opus, ogg, mp3, flac
and mulaw at the rates a client asks for. Formats are measured interleaved,
one repeat of each in turn, so that load from other processes hits all alike.

Usage::

    python bench/studies/encoder_cost.py [--seconds 20] [--repeats 5] \\
        [--out bench/results/studies/encoder-cost-<hw>]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness.machine import result_stem
from bench.studies.opus_cost import NATIVE, machine, measure, signal

CASES = [
    ("pcm16", 24_000),
    ("opus", 24_000),
    ("ogg", 24_000),
    ("mp3", 24_000),
    ("flac", 24_000),
    ("mulaw", 8_000),
    ("pcm16", 8_000),
    ("mp3", 48_000),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(result_stem("studies", "encoder-cost")))
    args = parser.parse_args()
    audio = signal("speech", args.seconds)
    runs: dict[tuple[str, int], list[dict[str, float]]] = {case: [] for case in CASES}
    for _ in range(args.repeats):
        for fmt, rate in CASES:
            runs[(fmt, rate)].append(measure(fmt, rate, audio))
    rows = []
    for (fmt, rate), results in runs.items():
        best = min(results, key=lambda r: r["cpu_s_per_audio_s"])
        rows.append({"format": fmt, "rate": rate, **best})
    versions = {p: version(p) for p in ("numpy", "opuslib", "soxr", "lameenc", "soundfile")}
    command = "python bench/studies/encoder_cost.py " + " ".join(sys.argv[1:])
    out = Path(args.out)
    out.with_suffix(".json").write_text(
        json.dumps({"command": command, "machine": machine(), "versions": versions, "rows": rows}, indent=1)
    )
    lines = [
        "# Encoder cost per audio-second, every format (CPU)",
        "",
        f"Command: `{command.strip()}`  ",
        f"Machine: {machine().get('cpu_model', '?')}, shared with other helpers' test suites; "
        f"{platform.platform()}  ",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        "",
        f"{args.seconds:.0f} s of the speech-like signal at {NATIVE} Hz through `make_encoder(...)` in "
        "8192-sample pushes, best of "
        f"{args.repeats} interleaved runs; CPU time of the encoding thread. Defaults: opus/ogg 32 kbit/s "
        "complexity 5, mp3 64 kbit/s CBR LAME quality 5, flac libsndfile default level. Rates other "
        "than 24 kHz include the resampler.",
        "",
        "| format | rate | CPU-s per audio-s | µs per 20 ms | ms per push (mean / max) | streams/core "
        "| kbit/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['rate']} | {r['cpu_s_per_audio_s']:.4f} | {r['us_per_20ms_frame']:.0f} | "
            f"{r['ms_per_push_341ms_mean']:.2f} / {r['ms_per_push_341ms_max']:.2f} | "
            f"{r['streams_per_core']:.0f} | {r['kbit_per_s']:.1f} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
