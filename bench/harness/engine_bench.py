"""What the in-process engine benchmarks (``bench.studies.dtype``, ``bench.studies.refine``) share.

Their model and output flags, the set-up those flags ask for, and how a result names its
model and the command that produced it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import torch


def engine_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser with the flags every engine bench has (model, device, threads, output)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument(
        "--make-model", action="store_true", help="write a full-size dev model there if missing"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="path without suffix: writes .json and .md")
    parser.add_argument("--render", action="store_true", help="only rewrite OUT.md from OUT.json")
    return parser


def prepare(args: argparse.Namespace) -> None:
    """Set torch's threads and write the full-size dev model when asked for and missing."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.make_model and not (args.model_dir / "DEV_MODEL.json").is_file():
        from server.engine.chattts.devmodel import make_dev_model

        make_dev_model("full", args.model_dir)


def model_kind(model_dir: Path) -> str:
    """What the weights in ``model_dir`` are, for the result file."""
    manifest = model_dir / "DEV_MODEL.json"
    if manifest.is_file():
        return f"random weights, make_dev_model('{json.loads(manifest.read_text())['size']}')"
    return f"weights in {model_dir}"


def command(module: str) -> str:
    """The command line that is running, as ``python -m <module> ...``."""
    return shlex.join(["python", "-m", module, *sys.argv[1:]])  # quoted: it can be run again as it is


def report_header(title: str, report: dict[str, Any]) -> list[str]:
    """A result's first markdown lines: its title, command, machine and whether it was shared."""
    m = report["machine"]
    return [
        f"# {title}",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {m.get('cpu_model')} ({m.get('cpu_cores')} cores), torch {m['versions'].get('torch')}, "
        f"{report['torch_threads']} torch threads, GPUs: {m.get('gpus') or 'none'}, "
        f"load average at start {m.get('loadavg_at_start')}. Shared: {report['shared_machine']}.",
        "",
    ]


def timed(seconds: MutableMapping[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, adding the wall time of each call to ``seconds[name]`` (a ``Counter`` or ``defaultdict``)."""

    def timed_call(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - began

    return timed_call
