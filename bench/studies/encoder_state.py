"""What one stream's encoder (and resampler) holds in memory, per format and rate (issue #42).

``python -m bench.studies.encoder_state [--n 1000]`` builds ``n`` encoders of one format and rate in
a fresh child process (so that one measurement's freed memory is not reused by the next),
pushes 0.5 s of audio through each (so that every lazily made buffer exists, as in a stream
between two events), and reports per encoder: the growth of the process's RSS (native
libopus/LAME/libFLAC/soxr state and Python objects alike) and tracemalloc's count (Python
objects only). ``server/audio/footprint.py`` keeps the larger of the two, rounded up.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tracemalloc

import numpy as np
import psutil

from server.audio import SUPPORTED_FORMATS, SUPPORTED_RATES, make_encoder


def measure(fmt: str, rate: int, n: int) -> dict[str, float]:
    """One format and rate, in this process: bytes per encoder (RSS growth, tracemalloc)."""
    audio = np.zeros(12_000, dtype=np.float32)
    proc = psutil.Process()
    keep = [make_encoder(fmt, rate)]  # import-time and first-use costs are not per encoder
    keep[0].push(audio)
    gc.collect()
    tracemalloc.start()
    rss0 = proc.memory_info().rss
    traced0 = tracemalloc.get_traced_memory()[0]
    for _ in range(n):
        encoder = make_encoder(fmt, rate)
        encoder.push(audio)
        keep.append(encoder)
    gc.collect()
    rss = (proc.memory_info().rss - rss0) / n
    traced = (tracemalloc.get_traced_memory()[0] - traced0) / n
    return {"rss_bytes": rss, "traced_bytes": traced}


def main(argv: list[str] | None = None) -> int:
    """Measure every format and rate, each in its own child process; print JSON."""
    p = argparse.ArgumentParser(prog="python -m bench.studies.encoder_state")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--one", default="", help="FORMAT:RATE, measured in this process")
    args = p.parse_args(argv)
    if args.one:
        fmt, rate = args.one.split(":")
        print(json.dumps(measure(fmt, int(rate), args.n)))
        return 0
    results = {}
    for fmt in SUPPORTED_FORMATS:
        for rate in SUPPORTED_RATES:
            cmd = [
                sys.executable,
                "-m",
                "bench.studies.encoder_state",
                "--n",
                str(args.n),
                "--one",
                f"{fmt}:{rate}",
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            results[f"{fmt}:{rate}"] = json.loads(out)
            print(f"{fmt}:{rate}", results[f"{fmt}:{rate}"], file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
