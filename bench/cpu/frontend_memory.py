"""What each process of the multi-process forms holds with ChatTTS (issue #47): RSS once ready.

``serve --engine chattts --engine-process`` and ``--frontend-processes 2`` on the tiny and the
full-size dev model (``--profile eager``, the CPU), and the fake engine's ``--engine-process``
for contrast: each form a ``serve`` subprocess, its process tree's RSS read once ``/ready``
answers and ``--settle-s`` later (a second child's warm-up ends too). A front end holds the
engine's text side only (tokenizer, normalizer, speaker statistics); the engine host holds the
model. RSS does not depend on the machine's load.

    python -m bench.cpu.frontend_memory --model-dir DIR --out bench/results/cpu/frontend-memory-<hw>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil

from bench.harness.machine import describe_machine
from tests.serverproc import free_port, spawn_server, wait_ready

FORMS = {"engine-process": ["--engine-process"], "frontend-processes 2": ["--frontend-processes", "2"]}


def _role(process: psutil.Process, top: int, form: str) -> str:
    if process.pid == top:
        return "supervisor" if form.startswith("frontend") else "front end"
    return "engine host" if "server.core.remote.host" in " ".join(process.cmdline()) else "front end"


async def measure(
    engine_flags: list[str], form: str, settle_s: float, timeout_s: float
) -> list[dict[str, Any]]:
    """The RSS of every process of one form, once it is ready."""
    port = free_port()
    flags = [*engine_flags, "--port", str(port), "--cache-bytes", "0", *FORMS[form]]
    proc = await spawn_server(*flags, env={**os.environ}, stderr=asyncio.subprocess.DEVNULL)
    try:
        await wait_ready(port, proc, timeout_s=timeout_s)
        await asyncio.sleep(settle_s)
        top = psutil.Process(proc.pid)
        return [
            {"role": _role(p, proc.pid, form), "pid": p.pid, "rss_mib": round(p.memory_info().rss / 2**20)}
            for p in [top, *top.children(recursive=True)]
        ]
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), timeout_s)


def report(results: list[dict[str, Any]], machine: dict[str, Any]) -> str:
    lines = [
        "# RSS of each process, ChatTTS with `--engine-process` and `--frontend-processes 2`",
        "",
        f"Machine: {machine.get('cpu_model')}, {machine.get('cpu_affinity')} cores; "
        f"commit {machine.get('git_commit')}.",
        "",
        "| model | form | process | RSS MiB |",
        "|---|---|---|---|",
    ]
    for run in results:
        for row in run["processes"]:
            lines.append(f"| {run['model']} | {run['form']} | {row['role']} | {row['rss_mib']} |")
    return "\n".join(lines) + "\n"


async def measure_all(tiny: str, full: str, settle_s: float, timeout_s: float) -> list[dict[str, Any]]:
    """The fake engine's engine process, then each form on the tiny and the full-size model."""
    chattts = ["--engine", "chattts", "--device", "cpu", "--profile", "eager"]
    runs: list[tuple[str, list[str], str]] = [("fake", ["--engine", "fake"], "engine-process")]
    for name, folder in (("tiny", tiny), ("full", full)):
        runs += [(name, [*chattts, "--model-dir", folder], form) for form in FORMS]
    results = []
    for model, flags, form in runs:
        processes = await measure(flags, form, settle_s, timeout_s)
        results.append({"model": model, "form": form, "processes": processes})
        print(model, form, [(p["role"], p["rss_mib"]) for p in processes], flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cpu.frontend_memory", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--model-dir", required=True, help="a full-size dev model (make-dev-model --size full)"
    )
    parser.add_argument(
        "--tiny-dir", default="", help="the tiny dev model (default: made in a temporary folder)"
    )
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--out", required=True, help="path stem: writes STEM.md and STEM.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        tiny = args.tiny_dir
        if not tiny:
            from server.engine.chattts.devmodel import make_dev_model

            tiny = str(Path(scratch) / "tiny")
            make_dev_model("tiny", Path(tiny))
        results = asyncio.run(measure_all(tiny, args.model_dir, args.settle_s, args.timeout_s))
    machine = describe_machine()
    Path(args.out + ".json").write_text(json.dumps({"machine": machine, "results": results}, indent=1) + "\n")
    Path(args.out + ".md").write_text(report(results, machine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
