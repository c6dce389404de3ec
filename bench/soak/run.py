"""Soak benchmark (issue #9): thousands of mixed requests against one server; RSS and fds stay flat.

``python -m bench.soak --requests 2000 --concurrency 12 --engine chattts --model-dir DIR``
starts a ``serve`` subprocess (short ``--resume-ttl-s``), then runs a seeded random
mix of requests with ``--concurrency`` workers, each request on its own connection(s):

- ``complete``: one stream, short/medium/long/extra-long text (up to the server's
  ``max_text_chars``), Chinese or English, ``pcm16`` or ``opus``; must end ``complete``;
- ``repeat``: the same, drawn from a small pool of (text, format, seed): cache hits;
- ``cancel``: ``cancel`` after a few frames; must end ``cancelled`` (or ``complete``
  when it finished first);
- ``abandon``: the socket is aborted after a few frames and never resumed; the stream
  must be freed after the TTL (a later ``resume`` of its token answers ``unknown_stream``);
- ``resume``: the socket is aborted once or twice, each time followed by ``resume`` on
  a new connection; the stream must complete with every seq received exactly once;
- ``incremental``: ``append`` pieces (with a ``flush``), then ``end``; must complete;
- ``multi``: 2 to ``max_streams`` streams at once on one connection;
- ``bad``: a bad input (malformed JSON, unknown type, too-long text, unsupported format,
  rate or voice, out-of-range field, binary frame, duplicate id, too many streams, ...)
  must get its error code, and a stream on the same connection afterwards must complete.

Every stream that got ``started`` is accounted for: it reached ``done`` (with the
expected reason, seqs 0..last_seq each exactly once, one last-frame flag), or it was
abandoned on purpose and verified freed; anything else is *lost*. The server's RSS, open
fds and ``/metrics`` gauges are sampled every second (:mod:`bench.soak.report`). After the
load, ``chattts_active_streams`` must return to 0 and SIGTERM must exit 0.

Writes ``OUT`` (JSON), ``OUT`` with ``.png`` (plot) and ``.md`` (report); exit status 1
when an acceptance check fails, 2 when the server could not start.

The pieces, one idea each: :mod:`bench.soak.cli` (flags), :mod:`bench.soak.plan` (the seeded
mix), :mod:`bench.soak.load` (the workers and one scenario per kind, over
:mod:`bench.soak.connection`), :mod:`bench.soak.verdict` (the tally and the acceptance checks),
:mod:`bench.soak.report` (samples, plot, markdown). This module runs them in order and writes
the results.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.client import fetch_hello
from bench.harness.machine import describe_machine
from bench.harness.sampler import Sampler, read_gauges, samples_as_dicts
from bench.harness.servers import CHILD_ENV, ServerProcess
from bench.harness.textset import load_texts
from bench.soak import churn as soak_churn
from bench.soak.cli import parse_args, server_flags
from bench.soak.load import Soak
from bench.soak.plan import BAD_INPUTS, KIND_WEIGHTS, SIZE_WEIGHTS, make_plan
from bench.soak.report import analyse_samples, markdown, plot
from bench.soak.verdict import acceptance_checks, summarize

SCHEMA = "chattts-stream-soak/1"


async def wait_active_zero(metrics_url: str, timeout_s: float) -> tuple[bool, float]:
    """Poll ``/metrics`` until ``chattts_active_streams`` is 0; (reached, seconds waited)."""
    began = time.perf_counter()
    while time.perf_counter() - began < timeout_s:
        gauges = await read_gauges(metrics_url)
        if gauges.get("chattts_active_streams") == 0:
            return True, time.perf_counter() - began
        await asyncio.sleep(0.25)
    return False, time.perf_counter() - began


async def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Start the server, soak it, judge the samples; returns the results."""
    if args.omp_wait_policy:
        CHILD_ENV.setdefault("OMP_WAIT_POLICY", args.omp_wait_policy)
    log_path = Path(tempfile.gettempdir()) / f"soak-server-{time.strftime('%Y%m%d-%H%M%S')}.log"
    server = ServerProcess(server_flags(args), log_path=log_path)
    await server.start()
    assert server.proc is not None
    metrics_url = f"http://127.0.0.1:{server.port}/metrics"
    exit_code: int | None = None
    try:
        hello = await fetch_hello(server.url)
        texts = load_texts(args.texts)
        plans = make_plan(
            args.requests, args.seed, texts, int(hello["max_text_chars"]), int(hello["max_streams"])
        )
        soak = Soak(server.url, hello, args)
        sampler = Sampler(server.proc.pid, metrics_url, args.sample_interval_s, lambda: soak.finished)
        sampler.t0 = time.perf_counter() + args.idle_s
        soak.clock = sampler.now
        sampler.start()
        try:
            await asyncio.sleep(args.idle_s)
            sampler.phase = "load"
            load_end = 0.0

            def on_load_end() -> None:
                nonlocal load_end
                load_end = sampler.now()
                sampler.phase = "drain"

            await soak.run(plans, args.concurrency, on_load_end)
            zero, zero_after = await wait_active_zero(metrics_url, soak.ttl_s + 60.0)
            gauges = await read_gauges(metrics_url)
            sampler.phase = "idle_after"
            await asyncio.sleep(args.idle_s)
        finally:
            await sampler.stop()
    finally:
        exit_code = await server.stop()
    finish = sorted(soak.finish_times)
    warm_n = max(1, math.ceil(args.requests * args.warmup_frac))
    warmup_end = finish[min(warm_n, len(finish)) - 1] if finish else 0.0
    memory = analyse_samples(sampler.samples, warmup_end, load_end, args.window_s)
    summary = summarize(soak.outcomes)
    checks = acceptance_checks(memory, summary, zero, exit_code)
    load_wall = load_end
    return {
        "schema": SCHEMA,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "bench.soak", *argv]),
        "machine": describe_machine(),
        "config": {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "engine": args.engine,
            "model": args.model_dir or args.dev_model,
            "seed": args.seed,
            "warmup_frac": args.warmup_frac,
            "window_s": args.window_s,
            "sample_interval_s": args.sample_interval_s,
            "resume_ttl_s": args.resume_ttl_s,
            "cache_bytes": args.cache_bytes,
            "free_margin_s": args.free_margin_s,
            "kind_weights": KIND_WEIGHTS,
            "size_weights": SIZE_WEIGHTS,
            "bad_inputs": BAD_INPUTS,
            "child_env": dict(CHILD_ENV),
        },
        "server": {**server.describe(), "hello": hello, "log": str(log_path)},
        "load_wall_s": load_wall,
        "requests_per_s": args.requests / load_wall if load_wall > 0 else None,
        "memory": memory,
        **summary,
        "cache": {
            "hits": gauges.get("chattts_cache_hits_total"),
            "misses": gauges.get("chattts_cache_misses_total"),
        },
        "end": {"active_streams_zero": zero, "active_zero_after_s": zero_after, "exit_code": exit_code},
        "acceptance": {"pass": all(checks.values()), "checks": checks},
        "requests": [o.compact() for o in sorted(soak.outcomes, key=lambda o: o.index)],
        "samples": samples_as_dicts(sampler.samples),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.soak``: run, write JSON/PNG/MD, exit 1 when an acceptance check fails."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv, (__doc__ or "").split("\n\n")[0])
    if args.engine == "chattts" and not (args.model_dir or args.dev_model):
        print("bench.soak: --engine chattts needs --model-dir or --dev-model", file=sys.stderr)
        return 2
    if args.churn:
        return soak_churn.main(args, argv)
    out: Path = args.out or Path(tempfile.gettempdir()) / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    try:
        import uvloop

        results = uvloop.run(run(args, argv))
    except RuntimeError as exc:
        print(f"bench.soak: {exc}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    png = out.with_suffix(".png")
    if not args.no_plot:
        plot(results, png)
    md = markdown(results, None if args.no_plot else png.name)
    out.with_suffix(".md").write_text(md, encoding="utf-8")
    print(md)
    print(f"bench.soak: wrote {out}", file=sys.stderr)
    return 0 if results["acceptance"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
