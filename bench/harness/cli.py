"""The command line of ``python -m bench``: its flags, the ``--smoke`` preset, and the files it writes.

The run itself (what is measured, in which order) is :class:`bench.harness.run.Harness`. It writes
``PREFIX.json`` (everything), ``PREFIX.md`` (the table), ``PREFIX-cdf.png`` and
``PREFIX-concurrency.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness.audio import DECODABLE_FORMATS
from bench.harness.report import markdown
from bench.harness.run import Harness
from bench.harness.servers import CHILD_ENV, REPO_ROOT
from bench.harness.textset import DEFAULT_TEXTS

BASELINES = ("b1", "infer", "engine")
RESULTS_DIR = REPO_ROOT / "bench" / "results"


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m bench`` arguments."""
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Latency and throughput of a protocol-v1 streaming TTS server, with baselines "
        "in the same run.",
    )
    target = p.add_argument_group("what to measure")
    target.add_argument(
        "--url", help="ws://HOST:PORT/v1/stream of a running server (default: start one here)"
    )
    target.add_argument(
        "--engine", default="chattts", choices=("chattts", "fake"), help="engine of a started server"
    )
    target.add_argument(
        "--model-dir", type=Path, help="ChatTTS asset folder: the started servers and in-process baselines"
    )
    target.add_argument(
        "--server-flags", default="", help="extra serve flags for started servers, one shell-quoted string"
    )
    target.add_argument(
        "--server-cmd", default="", help="command prefix that runs serve (default: python -m server serve)"
    )
    target.add_argument(
        "--baselines", default="b1,infer,engine", help=f"which of {','.join(BASELINES)} to run ('' = none)"
    )
    target.add_argument("--baseline-url", help="the max_batch=1 server to use as 'b1' when --url is given")
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", default="1,4,8,16", help="closed-loop scenarios (streams in flight)")
    load.add_argument("--rates", default="", help="open-loop scenarios (Poisson arrivals per second)")
    load.add_argument(
        "--duration", type=float, default=20.0, help="seconds per scenario (no new stream after)"
    )
    load.add_argument("--max-streams", type=int, default=500, help="streams per scenario at most")
    load.add_argument(
        "--grace-s", type=float, default=60.0, help="cut streams still running this long after the load"
    )
    load.add_argument("--timeout-s", type=float, default=180.0, help="per-stream timeout (error 'timeout')")
    load.add_argument(
        "--formats", default="pcm16,opus", help=f"formats to measure ({','.join(DECODABLE_FORMATS)})"
    )
    load.add_argument(
        "--texts", type=Path, default=DEFAULT_TEXTS, help="text set (.jsonl with text/lang/size, or lines)"
    )
    load.add_argument("--text-sizes", default="", help="keep only these sizes (short,medium,long)")
    load.add_argument("--text-langs", default="", help="keep only these languages (zh,en)")
    load.add_argument(
        "--max-audio-s", type=float, default=0.0, help="cancel each stream after this much audio (0 = no cap)"
    )
    load.add_argument(
        "--threads", type=int, default=0, help="torch threads of started servers and baselines (0 = default)"
    )
    load.add_argument(
        "--omp-wait-policy",
        default="PASSIVE",
        help="OMP_WAIT_POLICY of started servers and baselines ('' = inherit); PASSIVE keeps idle OpenMP "
        "threads from spinning, which on a shared CPU makes torch steps up to 100x slower",
    )
    load.add_argument(
        "--frame-ms",
        type=int,
        default=20,
        help="the start's frame_ms (20, 40, 60: longer frames, fewer messages; 20 is not sent)",
    )
    load.add_argument("--settle-s", type=float, default=0.5, help="pause between scenarios")
    load.add_argument("--seed", type=int, default=1, help="arrivals and per-stream seeds")
    load.add_argument("--engine-concurrency", default="8", help="batch sizes for the engine-direct baseline")
    measure = p.add_argument_group("measurement and output")
    measure.add_argument(
        "--jitter-ms", default="100,300", help="jitter-buffer start thresholds of the listener"
    )
    measure.add_argument(
        "--advice",
        action="store_true",
        help="also simulate a listener that honours the server's buffer advice (started.buffer_ms), "
        "starting on max(--advice-floor-ms, the advice)",
    )
    measure.add_argument(
        "--advice-floor-ms",
        type=float,
        default=300.0,
        help="the advised listener's own buffer: all it holds when the server gives no advice",
    )
    measure.add_argument("--out", type=Path, help="output prefix (default bench/results/harness/run-<time>)")
    measure.add_argument("--title", default="", help="one line describing the run, for plots and the table")
    measure.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    measure.add_argument(
        "--smoke",
        action="store_true",
        help="a few seconds of tiny scenarios (CI): against --url when given, else a fake server it starts",
    )
    return p


def apply_smoke(args: argparse.Namespace) -> None:
    """``--smoke``: tiny scenarios, both formats, the b1 baseline; done in a few seconds.

    With ``--url`` (and ``--baseline-url``) the smoke checks that running server, so a user can
    try the harness against a deployment; without it a fake-engine server is started here. The
    in-process baselines are skipped either way (no model).
    """
    args.engine, args.model_dir = "fake", None
    args.concurrency, args.rates, args.duration, args.grace_s, args.settle_s = "1,4", "8", 0.8, 10.0, 0.1
    args.timeout_s, args.max_streams, args.formats = 20.0, 40, "pcm16,opus"
    args.baselines, args.text_sizes, args.engine_concurrency = "b1,infer,engine", "short", "8"
    args.server_flags = args.server_flags or "--fake-step-ms 5 --fake-row-ms 0.5"
    args.title = args.title or (f"smoke ({args.url})" if args.url else "smoke (fake engine)")
    args.no_plots = True


def write_outputs(results: dict[str, Any], prefix: Path, plots: bool) -> list[Path]:
    """Write the JSON, the markdown table and (optionally) the plots."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    files = [prefix.with_name(prefix.name + ".json"), prefix.with_name(prefix.name + ".md")]
    if plots:
        from bench.harness.plots import write_plots

        results["plots"] = [Path(p).name for p in write_plots(results, prefix)]
        files += [prefix.with_name(n) for n in results["plots"]]
    files[0].write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    md = f"# {results['title']}\n\nCommand: `{results['command']}`\n\n" + markdown(results)
    files[1].write_text(md)
    return files


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (1 when a stream failed, 2 on a usage problem)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.smoke:
        apply_smoke(args)
    if args.out is None:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        args.out = (
            (Path(tempfile.gettempdir()) / f"bench-smoke-{stamp}")
            if args.smoke
            else RESULTS_DIR / "harness" / f"run-{stamp}"
        )
    if args.omp_wait_policy and "OMP_WAIT_POLICY" not in os.environ:
        CHILD_ENV["OMP_WAIT_POLICY"] = args.omp_wait_policy
    try:
        harness = Harness(args, argv)
    except (OSError, ValueError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    try:
        results = asyncio.run(harness.run())
    except RuntimeError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    files = write_outputs(results, args.out, plots=not args.no_plots)
    print(markdown(results))
    for f in files:
        print(f"bench: wrote {f}", file=sys.stderr)
    failed = sum(s["summary"]["error_streams"] for s in results["scenarios"])
    return 1 if failed else 0
