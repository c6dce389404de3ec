"""Shared plumbing of the in-process baselines (run as subprocesses of the harness).

Each baseline module (:mod:`bench.baselines.infer`, :mod:`bench.baselines.engine`)
loads the model once, runs one closed-loop scenario per concurrency and writes
their :class:`~bench.harness.latency.StreamRecord` lists as JSON; the harness turns
them into the same metrics as the server's streams. Running them in a child
process keeps torch out of the harness and frees the model's memory after.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.latency import StreamRecord
from bench.harness.load import LoadRun
from bench.harness.servers import REPO_ROOT, child_env, open_log
from bench.harness.textset import DEFAULT_TEXTS, BenchText, load_texts

#: ChatTTS: one audio token decodes to 512 samples at 24 kHz.
SAMPLES_PER_TOKEN = 512
SAMPLE_RATE = 24_000


def cap_tokens(max_audio_s: float, default: int = 2048) -> int:
    """Audio tokens matching the harness's per-stream audio cap (0 = ``default``)."""
    return math.ceil(max_audio_s * SAMPLE_RATE / SAMPLES_PER_TOKEN) if max_audio_s > 0 else default


def base_parser(description: str) -> argparse.ArgumentParser:
    """Arguments every in-process baseline takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model-dir", type=Path, required=True, help="ChatTTS asset folder (holds asset/)")
    parser.add_argument("--concurrency", default="1", help="comma-separated batch sizes, one scenario each")
    parser.add_argument(
        "--duration", type=float, default=20.0, help="seconds per scenario (no new batch after)"
    )
    parser.add_argument("--max-streams", type=int, default=1000, help="streams per scenario at most")
    parser.add_argument("--texts", type=Path, default=DEFAULT_TEXTS)
    parser.add_argument("--text-sizes", default="", help="comma-separated sizes to keep")
    parser.add_argument("--text-langs", default="", help="comma-separated languages to keep")
    parser.add_argument(
        "--seed", type=int, default=1, help="base of the job seeds (bench.harness.textset.seed_base)"
    )
    parser.add_argument(
        "--max-audio-s", type=float, default=0.0, help="token cap per stream as audio seconds"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    return parser


def texts_from(args: argparse.Namespace) -> list[BenchText]:
    """The text set the arguments select."""
    return load_texts(args.texts, sizes=_csv(args.text_sizes), langs=_csv(args.text_langs))


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def concurrencies(args: argparse.Namespace) -> list[int]:
    """The ``--concurrency`` list."""
    return [int(part) for part in _csv(args.concurrency)]


def write_results(path: Path, scenarios: list[dict[str, Any]], info: dict[str, Any]) -> None:
    """Write ``{"info": ..., "scenarios": [...]}`` (records as plain dicts)."""
    path.write_text(json.dumps({"info": info, "scenarios": scenarios}))


def scenario_result(concurrency: int, run: LoadRun, cpu_s: float) -> dict[str, Any]:
    """One scenario's records and window, ready for :func:`write_results`."""
    return {
        "concurrency": concurrency,
        "t_start": run.t_start,
        "t_stop": run.t_stop,
        "t_end": run.t_end,
        "cpu_s": cpu_s,
        "records": [dataclasses.asdict(r) for r in run.records],
    }


def record_from_dict(data: dict[str, Any]) -> StreamRecord:
    """Inverse of ``dataclasses.asdict`` for records read back from JSON."""
    data = dict(data)
    data["frames"] = [(float(t), int(n)) for t, n in data["frames"]]
    return StreamRecord(**data)


def cpu_now() -> float:
    """CPU seconds of this process (all threads)."""
    return time.process_time()


async def run_child(module: str, args: list[str], out: Path, log_path: Path | None) -> dict[str, Any]:
    """Run ``python -m module args --out out`` from the repository root and read its JSON.

    Raises:
        RuntimeError: the child failed (its log says why).
    """
    argv = [sys.executable, "-m", module, *args, "--out", str(out)]
    log = open_log(log_path)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            env=child_env(),
        )
        try:
            code = await proc.wait()
        except asyncio.CancelledError:
            proc.kill()
            await proc.wait()
            raise
    finally:
        if not isinstance(log, int):
            log.close()
    if code != 0:
        raise RuntimeError(f"{shlex.join(argv)} exited with {code} (see {log_path})")
    data = read_json(out)
    data["command"] = shlex.join(argv)
    return data


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file."""
    data: dict[str, Any] = json.loads(path.read_text())
    return data
