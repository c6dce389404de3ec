"""The soak's command line: its flags (the mix's and ``--churn``'s) and the ``serve`` flags they imply."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from bench.harness.textset import DEFAULT_TEXTS
from bench.soak.churn import DEFAULT_MARGIN_MIB


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """Command-line flags; ``description`` (``--help``'s) is :mod:`bench.soak.run`'s, the soak it runs."""
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=description)
    p.add_argument("--requests", type=int, default=2000, help="requests in all")
    p.add_argument("--concurrency", type=int, default=12, help="workers running requests at once")
    p.add_argument("--engine", choices=("chattts", "fake"), default="chattts")
    p.add_argument("--model-dir", default="", help="ChatTTS asset folder (e.g. a tiny dev model)")
    p.add_argument(
        "--dev-model", default="", choices=("", "tiny", "full"), help="serve a random-weight model"
    )
    p.add_argument("--resume-ttl-s", type=float, default=2.0, help="the server's --resume-ttl-s")
    p.add_argument(
        "--cache-bytes",
        type=int,
        default=8 * 1024 * 1024,
        help="the server's --cache-bytes: small, so the bounded response cache is full (and evicting) "
        "early in the warm-up instead of filling for most of the run",
    )
    p.add_argument("--server-flags", default="", help="further serve flags (shell-quoted)")
    p.add_argument("--seed", type=int, default=9, help="seeds the request mix")
    p.add_argument("--texts", type=Path, default=DEFAULT_TEXTS, help="text set (.jsonl with text/lang/size)")
    p.add_argument("--warmup-frac", type=float, default=0.1, help="warm-up: this share of requests finished")
    p.add_argument(
        "--window-s", type=float, default=60.0, help="RSS median windows after warm-up / at the end"
    )
    p.add_argument("--sample-interval-s", type=float, default=1.0)
    p.add_argument(
        "--idle-s", type=float, default=5.0, help="idle sampling before the load and after the drain"
    )
    p.add_argument(
        "--free-margin-s",
        type=float,
        default=3.0,
        help="slack after the TTL before checking a stream is freed",
    )
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument(
        "--omp-wait-policy", default="PASSIVE", help="OMP_WAIT_POLICY of the server ('' = inherit)"
    )
    p.add_argument("--out", type=Path, default=None, help="JSON path (.png and .md beside it)")
    p.add_argument("--no-plot", action="store_true")
    churn = p.add_argument_group(
        "churn (bench.soak.churn): start/cancel from one client, default server flags"
    )
    churn.add_argument("--churn", action="store_true", help="run the churn soak instead of the mix")
    churn.add_argument("--duration-s", type=float, default=600.0, help="churn: how long, after the warm-up")
    churn.add_argument(
        "--warmup-s", type=float, default=30.0, help="churn: warm-up (the same churn) before it"
    )
    churn.add_argument("--churn-connections", type=int, default=4, help="churn: the client's connections")
    churn.add_argument(
        "--margin-mib",
        type=float,
        default=DEFAULT_MARGIN_MIB,
        help="churn: RSS allowed above the warm baseline plus the server's memory budget",
    )
    return p.parse_args(argv)


def server_flags(args: argparse.Namespace) -> list[str]:
    """``serve`` flags of the server under test."""
    flags = ["--engine", args.engine, "--resume-ttl-s", str(args.resume_ttl_s), "--http-port", "0"]
    flags += ["--cache-bytes", str(args.cache_bytes), "--log-level", "warning"]
    if args.model_dir:
        flags += ["--model-dir", args.model_dir]
    if args.dev_model:
        flags += ["--dev-model", args.dev_model]
    return flags + shlex.split(args.server_flags)
