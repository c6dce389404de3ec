"""Start-up of the compiled CPU step: a cold cache dir against a warm one, interleaved (issue #46).

``python -m bench.cpu.startup --model-dir DIR --rounds 3 --out bench/results/cpu/startup-<hw>``

Each round runs ``chattts-stream compile`` (the engine's load and compile, as ``serve`` does it
before ``/ready``) twice in fresh processes: first into an empty cache dir (cold), then again
into the same one (warm: the keyed folder :mod:`server.engine.chattts.step.compile_cache`
sealed). Reported per run: the wall time of the process, the compile time the engine logged, and
how many graphs' code came from the folder; then min and median per kind. A shared machine
only ever adds time, so the minimum is the better estimate of the machine's own cost, and the
load average after each run is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.machine import describe_machine

LINE = re.compile(r"compiled the token step \(inductor\) in ([\d.]+) s: (\d+) of (\d+) graphs")


def one_run(model_dir: Path, cache_dir: Path, flags: list[str]) -> dict[str, Any]:
    """One ``chattts-stream compile`` process: wall seconds, logged compile seconds, graphs from the cache."""
    ours = ("CHATTTS_", "TORCHINDUCTOR", "TORCH_EXT")  # the run's cache dir decides, not the caller's
    env = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    command = [sys.executable, "-m", "server", "compile", "--model-dir", str(model_dir), "--device", "cpu"]
    command += ["--cache-dir", str(cache_dir), "--compile-step", "on", *flags]
    began = time.perf_counter()
    run = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - began
    found = LINE.search(run.stderr)
    if run.returncode != 0 or found is None:
        raise RuntimeError(f"compile failed ({run.returncode}): {run.stderr[-2000:]}")
    return {
        "wall_s": round(wall, 1),
        "compile_s": float(found.group(1)),
        "graphs_from_cache": int(found.group(2)),
        "graphs": int(found.group(3)),
        "load_average": os.getloadavg(),
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Min and median of the wall and compile times."""
    out: dict[str, float] = {}
    for key in ("wall_s", "compile_s"):
        values = [r[key] for r in runs]
        out[f"{key}_min"], out[f"{key}_median"] = min(values), round(statistics.median(values), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flags", default="--quantize w8a8 --dtype bfloat16 --max-batch 8")
    parser.add_argument("--out", type=Path, required=True, help="path stem: writes .json")
    args = parser.parse_args(argv)
    flags = args.flags.split()
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    for round_ in range(args.rounds):
        cache = Path(tempfile.mkdtemp(prefix="startup-"))
        try:
            for kind in ("cold", "warm"):
                runs[kind].append(one_run(args.model_dir, cache, flags))
                print(round_, kind, runs[kind][-1], flush=True)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    result = {
        "machine": describe_machine(),
        "model_dir": str(args.model_dir),
        "flags": args.flags,
        "runs": runs,
        "summary": {kind: summary(r) for kind, r in runs.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
