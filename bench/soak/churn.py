"""The churn soak (issue #42, acceptance 4): one keyless client starts and cancels streams for minutes.

``python -m bench.soak --churn --engine fake --duration-s 600`` starts a ``serve`` subprocess
with the default flags (only the engine, ``--http-port 0`` and the log level are set), warms it
up with the same churn for ``--warmup-s``, then, for ``--duration-s``, one client (one IP, no
API key) keeps ``--churn-connections`` WebSocket connections busy, each with ``max_streams``
loops of: ``start`` (every format in turn, all at 48 kHz), wait for ``started``, ``cancel``,
wait for ``done``. Every cancelled stream ends and is kept for a resume: before issue #42 each
kept its encoder and resampler for the resume TTL, uncounted, and RSS grew without bound.

The server's RSS and its ``chattts_buffered_bytes`` / ``chattts_active_streams`` gauges are
sampled every ``--sample-interval-s``. The warm baseline is the median RSS over the last
``--window-s`` of the warm-up. Verdict: pass when the largest RSS during the churn stays under
baseline + ``--memory-budget-bytes`` (the server's, read from its flags) + ``--margin-mib``,
no request went wrong, and SIGTERM exits 0. Also reported (not judged): the growth of the
median RSS from the first to the last window of the churn, and its slope.

Writes ``OUT`` (JSON), ``.md`` and ``.png`` beside it; exit 1 when the verdict is fail.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import shlex
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from websockets.asyncio.client import ClientConnection, connect

from bench.harness.client import fetch_hello
from bench.harness.machine import describe_machine
from bench.harness.sampler import fetch_metrics_text, parse_metrics
from bench.harness.servers import CHILD_ENV, ServerProcess
from server.audio import SUPPORTED_FORMATS
from server.config import load_settings

SCHEMA = "chattts-stream-soak-churn/1"
RATE = 48_000
TEXT = "This stream is started and cancelled at once, again and again. " * 8
#: RSS above baseline + memory budget allowed for what the budget does not see: the
#: allocator's free lists and fragmentation after churn, the event loop's and the
#: libraries' caches, and the metrics.
DEFAULT_MARGIN_MIB = 64.0
WAIT_S = 60.0  # a reply that takes longer than this is a problem (the server is stuck)
GAUGES = ("chattts_active_streams", "chattts_buffered_bytes")


@dataclass
class Tally:
    """What the churn did so far."""

    cycles: Counter[str] = field(default_factory=Counter)  # started and cancelled, by format
    refused: Counter[str] = field(default_factory=Counter)  # error codes of refused starts
    frames: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.cycles.values())


async def churn_connection(url: str, index: int, until: float, tally: Tally) -> None:
    """One connection: ``max_streams`` loops of start → started → cancel → done until ``until``."""
    async with connect(url, compression=None, max_size=None) as ws:
        hello = json.loads(await asyncio.wait_for(ws.recv(), WAIT_S))
        inboxes: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        reader = asyncio.create_task(_read(ws, inboxes, tally), name=f"churn-reader-{index}")
        try:
            loops = [
                _loop(ws, f"{index}.{k}", until, inboxes, tally) for k in range(int(hello["max_streams"]))
            ]
            await asyncio.gather(*loops)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)


async def _read(
    ws: ClientConnection, inboxes: dict[str, asyncio.Queue[dict[str, Any]]], tally: Tally
) -> None:
    async for raw in ws:
        if isinstance(raw, bytes):
            tally.frames += 1
            continue
        message = json.loads(raw)
        inbox = inboxes.get(message.get("id", ""))
        if inbox is not None:
            inbox.put_nowait(message)


async def _loop(
    ws: ClientConnection,
    name: str,
    until: float,
    inboxes: dict[str, asyncio.Queue[dict[str, Any]]],
    tally: Tally,
) -> None:
    k = 0
    while time.monotonic() < until and not tally.problems:
        fmt = SUPPORTED_FORMATS[(tally.total + k) % len(SUPPORTED_FORMATS)]
        sid, k = f"{name}.{k}", k + 1
        inbox = inboxes[sid] = asyncio.Queue()
        try:
            await ws.send(
                json.dumps({"type": "start", "id": sid, "text": TEXT, "format": fmt, "sample_rate": RATE})
            )
            first = await asyncio.wait_for(inbox.get(), WAIT_S)
            if first["type"] == "error":  # refused (overloaded, rate limited): counted, tried again
                tally.refused[str(first.get("code"))] += 1
                await asyncio.sleep(0.05)
                continue
            if first["type"] != "started":
                tally.problems.append(f"{sid}: {first}")
                return
            await ws.send(json.dumps({"type": "cancel", "id": sid}))
            while (message := await asyncio.wait_for(inbox.get(), WAIT_S))["type"] != "done":
                if message["type"] == "error":
                    tally.problems.append(f"{sid}: {message}")
                    return
            tally.cycles[fmt] += 1
        except TimeoutError:
            tally.problems.append(f"{sid}: no answer within {WAIT_S:.0f} s")
            return
        finally:
            del inboxes[sid]


class Sampler:
    """The server's RSS and gauges every ``interval_s``; owns its task."""

    def __init__(self, pid: int, metrics_url: str, interval_s: float, tally: Tally) -> None:
        self.process = psutil.Process(pid)
        self.metrics_url = metrics_url
        self.interval_s = interval_s
        self.tally = tally
        self.t0 = time.monotonic()
        self.phase = "idle_before"
        self.samples: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        next_at = time.monotonic()
        while True:
            try:
                rss = int(self.process.memory_info().rss)
                text = await asyncio.to_thread(fetch_metrics_text, self.metrics_url)
            except (psutil.Error, OSError):
                return
            gauges = parse_metrics(text, GAUGES)
            self.samples.append(
                {
                    "t": round(time.monotonic() - self.t0, 3),
                    "phase": self.phase,
                    "rss_bytes": rss,
                    "buffered_bytes": gauges.get("chattts_buffered_bytes"),
                    "active_streams": gauges.get("chattts_active_streams"),
                    "cycles": self.tally.total,
                }
            )
            next_at += self.interval_s
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="churn-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def server_flags(args: argparse.Namespace) -> list[str]:
    """The server's flags: its defaults, but for the engine, the HTTP port (off) and the log level."""
    flags = ["--engine", args.engine, "--http-port", "0", "--log-level", "warning"]
    if args.model_dir:
        flags += ["--model-dir", args.model_dir]
    if args.dev_model:
        flags += ["--dev-model", args.dev_model]
    return flags + shlex.split(args.server_flags)


async def _churn(url: str, args: argparse.Namespace, seconds: float, tally: Tally) -> None:
    until = time.monotonic() + seconds
    await asyncio.gather(*(churn_connection(url, i, until, tally) for i in range(args.churn_connections)))


def _median_mib(samples: list[dict[str, Any]]) -> float | None:
    values = [s["rss_bytes"] / 2**20 for s in samples]
    return round(statistics.median(values), 1) if values else None


def judge(samples: list[dict[str, Any]], args: argparse.Namespace, budget: int) -> dict[str, Any]:
    """The memory numbers and the RSS check."""
    warm = [s for s in samples if s["phase"] == "warmup"]
    churn = [s for s in samples if s["phase"] == "churn"]
    end_warm = warm[-1]["t"] if warm else 0.0
    baseline = _median_mib([s for s in warm if s["t"] >= end_warm - args.window_s])
    peak = max((s["rss_bytes"] for s in churn), default=0) / 2**20
    limit = None if baseline is None else baseline + budget / 2**20 + args.margin_mib
    first = _median_mib([s for s in churn if s["t"] <= churn[0]["t"] + args.window_s]) if churn else None
    last = _median_mib([s for s in churn if s["t"] >= churn[-1]["t"] - args.window_s]) if churn else None
    slope = None
    if len(churn) >= 3:
        ts = [s["t"] for s in churn]
        vs = [s["rss_bytes"] / 2**20 for s in churn]
        slope = round(statistics.linear_regression(ts, vs).slope * 3600, 1)
    buffered = [s["buffered_bytes"] for s in churn if s["buffered_bytes"] is not None]
    return {
        "baseline_mib": baseline,
        "budget_mib": round(budget / 2**20, 1),
        "margin_mib": args.margin_mib,
        "limit_mib": None if limit is None else round(limit, 1),
        "peak_mib": round(peak, 1),
        "peak_over_baseline_mib": None if baseline is None else round(peak - baseline, 1),
        "first_window_median_mib": first,
        "last_window_median_mib": last,
        "slope_mib_per_hour": slope,
        "buffered_max_mib": round(max(buffered) / 2**20, 2) if buffered else None,
        "rss_under_limit": limit is not None and bool(churn) and peak <= limit,
    }


async def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Start the server, warm it up, churn, judge; returns the results."""
    if args.omp_wait_policy:
        CHILD_ENV.setdefault("OMP_WAIT_POLICY", args.omp_wait_policy)
    flags = server_flags(args)
    budget = load_settings(flags, env={}).memory_budget_bytes
    log_path = Path(tempfile.gettempdir()) / f"soak-churn-server-{time.strftime('%Y%m%d-%H%M%S')}.log"
    server = ServerProcess(flags, log_path=log_path)
    await server.start()
    assert server.proc is not None
    tally = Tally()
    sampler = Sampler(
        server.proc.pid, f"http://127.0.0.1:{server.port}/metrics", args.sample_interval_s, tally
    )
    exit_code: int | None = None
    try:
        hello = await fetch_hello(server.url)
        sampler.start()
        await asyncio.sleep(args.idle_s)
        sampler.phase = "warmup"
        await _churn(server.url, args, args.warmup_s, tally)
        warm_cycles = tally.total
        sampler.phase = "churn"
        began = time.monotonic()
        await _churn(server.url, args, args.duration_s, tally)
        churn_s = time.monotonic() - began
        sampler.phase = "idle_after"
        await asyncio.sleep(args.idle_s)
    finally:
        await sampler.stop()
        exit_code = await server.stop()
    memory = judge(sampler.samples, args, budget)
    checks = {
        "rss_under_budget_plus_baseline_plus_margin": memory["rss_under_limit"],
        "every_cycle_as_expected": not tally.problems and tally.total > warm_cycles,
        "clean_exit_on_sigterm": exit_code == 0,
    }
    cycles = tally.total - warm_cycles
    return {
        "schema": SCHEMA,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "bench.soak", *argv]),
        "machine": describe_machine(),
        "config": {
            "engine": args.engine,
            "duration_s": args.duration_s,
            "warmup_s": args.warmup_s,
            "churn_connections": args.churn_connections,
            "max_streams": hello["max_streams"],
            "formats": list(SUPPORTED_FORMATS),
            "sample_rate": RATE,
            "window_s": args.window_s,
            "sample_interval_s": args.sample_interval_s,
        },
        "server": {**server.describe(), "log": str(log_path), "memory_budget_bytes": budget},
        "churn": {
            "cycles": cycles,
            "cycles_per_s": round(cycles / churn_s, 1) if churn_s > 0 else None,
            "cycles_by_format": dict(tally.cycles),
            "refused": dict(tally.refused),
            "frames_received": tally.frames,
            "problems": tally.problems[:20],
        },
        "memory": memory,
        "end": {"exit_code": exit_code},
        "acceptance": {"pass": all(checks.values()), "checks": checks},
        "samples": sampler.samples,
    }


def markdown(results: dict[str, Any], plot_name: str | None) -> str:
    """The report."""
    m, c, cfg = results["memory"], results["churn"], results["config"]
    verdict = "PASS" if results["acceptance"]["pass"] else "FAIL"
    lines = [
        f"# Churn soak: {verdict}",
        "",
        f"`{results['command']}` ({results['created']}); server: `{results['server']['command']}`",
        "",
        "| what | value |",
        "|---|---|",
        f"| churn | {cfg['duration_s']:.0f} s after {cfg['warmup_s']:.0f} s of warm-up; "
        f"{c['cycles']} start/cancel cycles ({c['cycles_per_s']}/s), every format at 48 kHz |",
        f"| cycles by format | {', '.join(f'{k} {v}' for k, v in sorted(c['cycles_by_format'].items()))} |",
        f"| refused starts | {c['refused'] or 'none'} |",
        f"| warm baseline RSS (median, last {cfg['window_s']:.0f} s of warm-up) | {m['baseline_mib']} MiB |",
        f"| limit = baseline + memory budget + margin | {m['baseline_mib']} + {m['budget_mib']} + "
        f"{m['margin_mib']} = {m['limit_mib']} MiB |",
        f"| peak RSS during the churn | {m['peak_mib']} MiB ({m['peak_over_baseline_mib']} MiB above) |",
        f"| median RSS, first / last window of the churn | {m['first_window_median_mib']} / "
        f"{m['last_window_median_mib']} MiB (slope {m['slope_mib_per_hour']} MiB/h) |",
        f"| largest `chattts_buffered_bytes` | {m['buffered_max_mib']} MiB |",
        f"| SIGTERM exit code | {results['end']['exit_code']} |",
        "",
        "| check | result |",
        "|---|---|",
        *(f"| {k} | {'pass' if v else 'FAIL'} |" for k, v in results["acceptance"]["checks"].items()),
    ]
    if c["problems"]:
        lines += ["", "Problems:", *(f"- {p}" for p in c["problems"])]
    if plot_name:
        lines += ["", f"![RSS over time]({plot_name})"]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    """RSS and buffered bytes against time, with the baseline and the limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples, m = results["samples"], results["memory"]
    t = [s["t"] for s in samples]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.plot(t, [s["rss_bytes"] / 2**20 for s in samples], lw=1.2, label="RSS")
    buffered = [(s["t"], s["buffered_bytes"] / 2**20) for s in samples if s["buffered_bytes"] is not None]
    ax.plot([x for x, _ in buffered], [y for _, y in buffered], lw=1, label="chattts_buffered_bytes")
    if m["baseline_mib"] is not None:
        ax.axhline(m["baseline_mib"], color="tab:green", ls=":", lw=1, label="warm baseline")
        ax.axhline(m["limit_mib"], color="tab:red", ls=":", lw=1, label="baseline + budget + margin")
    starts = [s["t"] for s in samples if s["phase"] == "churn"]
    if starts:
        ax.axvline(starts[0], color="grey", lw=0.8)
    ax.set_xlabel("s")
    ax.set_ylabel("MiB")
    ax.set_yscale("log")
    ax.legend(loc="center right", fontsize=8)
    ax.set_title("start/cancel churn, one client, every format at 48 kHz")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace, argv: list[str]) -> int:
    """``python -m bench.soak --churn``: run, write JSON/MD/PNG, exit 1 when the verdict is fail."""
    out: Path = args.out or Path(tempfile.gettempdir()) / f"soak-churn-{time.strftime('%Y%m%d-%H%M%S')}.json"
    import uvloop

    try:
        results = uvloop.run(run(args, argv))
    except RuntimeError as exc:
        print(f"bench.soak --churn: {exc}")
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    png = out.with_suffix(".png")
    if not args.no_plot:
        with contextlib.suppress(ImportError):
            plot(results, png)
    md = markdown(results, None if args.no_plot or not png.exists() else png.name)
    out.with_suffix(".md").write_text(md, encoding="utf-8")
    print(md)
    return 0 if results["acceptance"]["pass"] else 1
