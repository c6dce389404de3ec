"""``python -m bench.studies.stream_timeline``: when each stream's audio arrived, one stream at a time.

The load harness (``python -m bench``) says how many streams under-ran; this says where. It
runs streams back to back (one at a time, as the harness's c1 does, the same jobs: texts in
round-robin order, seed ``--seed-base + k``), and for each prints its RTF, the simulated
listener's underruns and stall at ``--jitter-ms``, the longest gap, and its block arrivals:
frames that arrived within ``--merge-ms`` of each other are one block (the server sends a
block's frames together), shown as (seconds after the request, tokens of audio in it, audio
so far). A gap after a block of a few tokens is a segment boundary (the next segment's
prefill and first short block).

    python -m bench.studies.stream_timeline --url ws://127.0.0.1:8080/v1/stream --streams 14 --out X.json
    python -m bench.studies.stream_timeline --server-flags "--engine fake" --streams 2   # a server it starts
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.harness.client import StreamOptions, run_stream
from bench.harness.inproc import SAMPLES_PER_TOKEN
from bench.harness.latency import StreamRecord, stream_metrics
from bench.harness.servers import ServerProcess
from bench.harness.textset import DEFAULT_TEXTS, job, load_texts


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m bench.studies.stream_timeline`` arguments."""
    p = argparse.ArgumentParser(
        prog="python -m bench.studies.stream_timeline", description=__doc__.split("\n\n")[0]
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server's ws://.../v1/stream")
    where.add_argument("--server-flags", help="start `python -m server serve` with these flags instead")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--seed-base", type=int, default=424242)
    p.add_argument("--texts", type=Path, default=DEFAULT_TEXTS)
    p.add_argument("--text-sizes", default="medium,long")
    p.add_argument("--max-audio-s", type=float, default=6.0, help="cancel a stream after this much audio")
    p.add_argument("--long-s", type=float, default=4.0, help="the summary's streams: at least this long")
    p.add_argument("--jitter-ms", type=float, default=300.0, help="the simulated listener's buffer")
    p.add_argument("--merge-ms", type=float, default=20.0, help="frames this close are one block")
    p.add_argument("--timeout-s", type=float, default=240.0)
    p.add_argument("--out", type=Path, help="write every stream's figures and blocks as JSON")
    return p


def blocks(record: StreamRecord, merge_s: float) -> list[tuple[float, float, float]]:
    """``(seconds after the request, tokens of audio, audio seconds so far)`` per block of frames."""
    merged: list[list[float]] = []
    for t, samples in record.frames:
        if merged and t - merged[-1][0] < merge_s:
            merged[-1][1] += samples
        else:
            merged.append([t, samples])
    out: list[tuple[float, float, float]] = []
    total = 0.0
    for arrived, block_samples in merged:
        total += block_samples
        since, tokens = round(arrived - record.t_send, 3), round(block_samples / SAMPLES_PER_TOKEN, 1)
        out.append((since, tokens, round(total / record.sample_rate, 3)))
    return out


def stream_row(record: StreamRecord, jitter_ms: float, merge_s: float) -> dict[str, Any]:
    """One stream's figures: audio, RTF, the listener's underruns and stall, longest gap, blocks."""
    m = stream_metrics(record, [jitter_ms])
    listener = m["listener"][0] if m["listener"] else {"underruns": 0, "stall_s": 0.0, "start_s": None}
    return {
        "job": record.job,
        "errors": m["errors"],
        "audio_s": m["audio_s"],
        "rtf": m["rtf"],
        "ttfa_s": m["ttfa_s"],
        "underruns": listener["underruns"],
        "stall_s": listener["stall_s"],
        "listener_start_s": listener["start_s"],
        "max_gap_s": m["max_gap_s"],
        "blocks": blocks(record, merge_s),
    }


def summary(rows: list[dict[str, Any]], long_s: float) -> dict[str, Any]:
    """Over the streams of at least ``long_s``: how many, RTF p50, how many under-ran."""
    long = [r for r in rows if r["audio_s"] >= long_s - 1e-6 and r["rtf"] is not None]
    return {
        "streams": len(rows),
        "long_streams": len(long),
        "long_rtf_p50": statistics.median(r["rtf"] for r in long) if long else None,
        "long_underrun_streams": sum(1 for r in long if r["underruns"]),
        "errors": sum(1 for r in rows if r["errors"]),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every stream in turn; the server started first when ``--server-flags`` asks for one."""
    server = ServerProcess(shlex.split(args.server_flags)) if args.server_flags is not None else None
    if server is not None:
        await server.start(timeout_s=600)
    url = server.url if server is not None else args.url
    try:
        texts = load_texts(args.texts, sizes=tuple(s for s in args.text_sizes.split(",") if s))
        options = StreamOptions(max_audio_s=args.max_audio_s, timeout_s=args.timeout_s)
        rows = []
        for k in range(args.streams):
            record = await run_stream(url, job(texts, k, args.seed_base), options)
            row = stream_row(record, args.jitter_ms, args.merge_ms / 1000.0)
            rows.append(row)
            print(
                f"stream {k}: {row['audio_s']:.2f} s, RTF {row['rtf'] or float('nan'):.2f}, "
                f"{row['underruns']} underruns ({row['stall_s']:.3f} s) at {args.jitter_ms:g} ms, "
                f"longest gap {row['max_gap_s'] or 0:.3f} s; blocks {row['blocks']}",
                flush=True,
            )
    finally:
        if server is not None:
            await server.stop()
    return {
        "url": url,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "summary": summary(rows, args.long_s),
        "streams": rows,
    }


def main(argv: list[str] | None = None) -> int:
    """Run, print each stream and the summary, write the JSON."""
    args = build_parser().parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result["summary"]), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if not result["summary"]["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
