"""Start-up of the compiled CPU step: a cold cache dir against a warm one, interleaved (issue #46).

``python -m bench.cpu.startup --model-dir DIR --rounds 3 --out bench/results/cpu/startup-<hw>``

Each round starts twice in fresh processes: first into an empty cache dir (cold), then again
into the same one (warm: the keyed folder :mod:`server.engine.chattts.step.compile_cache`
sealed). By default a start is ``chattts-stream compile`` (the engine's load and compile, as
``serve`` does it before ``/ready``); with ``--serve`` it is ``chattts-stream serve`` timed to
``/ready`` (warm-up included: what a user waits for). ``--flags`` are added to both (default:
none, the server's defaults: ``--profile realtime``, on an x86-64 CPU the compiled w8a8 step).
Reported per run: the wall time of the process (``serve``: to ``/ready``), the compile time the
engine logged, and how many graphs' code came from the folder; then min and median per kind. A
shared machine only ever adds time, so the minimum is the better estimate of the machine's own
cost, and the load average after each run is kept.
"""

from __future__ import annotations

import argparse
import asyncio
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
WARNING = re.compile(r"refused|not loaded|FALLBACK|no compiled graph")


#: Longest a ``serve`` start may take before the run fails (a cold compile on two loaded cores).
SERVE_TIMEOUT_S = 1800.0


def _env() -> dict[str, str]:
    """The caller's environment less what would decide for the run (its cache dir, a profile)."""
    ours = ("CHATTTS_", "TORCHINDUCTOR", "TORCH_EXT")
    return {k: v for k, v in os.environ.items() if not k.startswith(ours)}


def one_run(model_dir: Path, cache_dir: Path, flags: list[str]) -> dict[str, Any]:
    """One ``chattts-stream compile`` process: wall seconds, logged compile seconds, graphs from the cache."""
    command = [sys.executable, "-m", "server", "compile", "--model-dir", str(model_dir), "--device", "cpu"]
    command += ["--cache-dir", str(cache_dir), *flags]
    began = time.perf_counter()
    run = subprocess.run(command, env=_env(), capture_output=True, text=True, check=False)
    wall = time.perf_counter() - began
    return _figures(wall, run.stderr, run.returncode)


def one_serve(model_dir: Path, cache_dir: Path, flags: list[str]) -> dict[str, Any]:
    """One ``chattts-stream serve`` process timed to ``/ready``, then stopped."""
    from bench.harness.servers import ServerProcess

    log = cache_dir.parent / f"{cache_dir.name}-serve.log"
    log.unlink(missing_ok=True)
    server = ServerProcess(
        ["--model-dir", str(model_dir), "--device", "cpu", "--cache-dir", str(cache_dir), *flags],
        log_path=log,
        env={**_env(), "PYTHONUNBUFFERED": "1"},
    )

    async def start_and_stop() -> None:
        try:
            await server.start(timeout_s=SERVE_TIMEOUT_S)
        finally:
            await server.stop()

    asyncio.run(start_and_stop())
    assert server.ready_s is not None
    figures = _figures(server.ready_s, log.read_text(errors="replace"), 0)
    log.unlink()  # kept only when the start failed
    return figures


def _figures(wall: float, logged: str, returncode: int) -> dict[str, Any]:
    found = LINE.search(logged)
    if returncode != 0 or found is None:
        raise RuntimeError(f"start failed ({returncode}) or compiled no step: {logged[-2000:]}")
    return {
        "wall_s": round(wall, 1),
        "compile_s": float(found.group(1)),
        "graphs_from_cache": int(found.group(2)),
        "graphs": int(found.group(3)),
        "load_average": os.getloadavg(),
        # Why a start found less than it should (a refused folder, a graph not loaded): kept,
        # since the log itself is deleted after a start that succeeded.
        "warnings": [line[-300:] for line in logged.splitlines() if WARNING.search(line)],
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
    parser.add_argument("--flags", default="", help="added to every start (default: the server's defaults)")
    parser.add_argument("--serve", action="store_true", help="time `serve` to /ready instead of `compile`")
    parser.add_argument("--out", type=Path, required=True, help="path stem: writes .json")
    args = parser.parse_args(argv)
    flags = args.flags.split()
    start = one_serve if args.serve else one_run
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    for round_ in range(args.rounds):
        cache = Path(tempfile.mkdtemp(prefix="startup-"))
        try:
            for kind in ("cold", "warm"):
                runs[kind].append(start(args.model_dir, cache, flags))
                print(round_, kind, runs[kind][-1], flush=True)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    result = {
        "machine": describe_machine(),
        "model_dir": str(args.model_dir),
        "flags": args.flags,
        "command": "serve, to /ready" if args.serve else "compile",
        "runs": runs,
        "summary": {kind: summary(r) for kind, r in runs.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
