"""One ``python -m bench`` run: the server, then the baselines, measured into one results dict.

A run measures the *server* (a URL, or a server the harness starts) under
closed-loop and open-loop load, and, in the same run, the baselines:

* ``server-b1``: the same server with ``--max-batch 1`` (started by the
  harness, or ``--baseline-url``);
* ``chattts-infer``: ChatTTS's own ``infer(stream=True)`` in-process
  (:mod:`bench.baselines.infer`; needs ``--model-dir``);
* ``engine-direct``: ``ChatTTSEngine`` stepping N sequences in-process
  (:mod:`bench.baselines.engine`; needs ``--model-dir``), the ceiling for issue #4.

:class:`Harness` takes the parsed command line (:mod:`bench.harness.cli`) and returns the results;
writing them is the command line's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness import inproc
from bench.harness.audio import DECODABLE_FORMATS
from bench.harness.client import StreamOptions, fetch_hello, run_stream
from bench.harness.latency import StreamRecord, stream_metrics
from bench.harness.load import LoadRun, LoadSpec, run_load
from bench.harness.machine import describe_machine
from bench.harness.report import throughput_ratios
from bench.harness.servers import CHILD_ENV, ServerProcess
from bench.harness.stats import summarize
from bench.harness.textset import load_texts, seed_base


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


class Harness:
    """One run: settings, the started servers, scenarios and skips, gathered into the results."""

    def __init__(self, args: argparse.Namespace, argv: Sequence[str]) -> None:
        self.args = args
        self.argv = list(argv)
        self.texts = load_texts(
            args.texts, sizes=tuple(_csv(args.text_sizes)), langs=tuple(_csv(args.text_langs))
        )
        self.jitter_ms = [float(x) for x in _csv(args.jitter_ms)]
        self.advice_floor_ms: float | None = args.advice_floor_ms if args.advice else None
        self.formats = _csv(args.formats)
        self.baselines = _csv(args.baselines)
        self.loads = [
            LoadSpec("closed", concurrency=int(c), **self._bounds()) for c in _csv(args.concurrency)
        ]
        self.loads += [LoadSpec("open", rate=float(r), **self._bounds()) for r in _csv(args.rates)]
        self.scenarios: list[dict[str, Any]] = []
        self.systems: dict[str, Any] = {}
        self.skipped: list[dict[str, str]] = []
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-"))

    def _bounds(self) -> dict[str, Any]:
        a = self.args
        return {"duration_s": a.duration, "max_streams": a.max_streams, "grace_s": a.grace_s, "seed": a.seed}

    def skip(self, what: str, why: str) -> None:
        """Record (and print) something the run could not measure."""
        self.skipped.append({"what": what, "why": why})
        print(f"bench: skipping {what}: {why}", file=sys.stderr)

    def add_scenario(
        self,
        system: str,
        spec: LoadSpec,
        fmt: str,
        records: list[StreamRecord],
        run: LoadRun,
        cpu_s: float | None,
        client_cpu_s: float | None = None,
    ) -> dict[str, Any]:
        """Turn records into metrics and a summary; keep it for the results."""
        metrics = [stream_metrics(r, self.jitter_ms, self.advice_floor_ms) for r in records]
        summary = summarize(
            records,
            metrics,
            t_start=run.t_start,
            t_stop=run.t_stop,
            t_end=run.t_end,
            cpu_s=cpu_s,
            client_cpu_s=client_cpu_s,
        )
        streams = [{k: _round(v) for k, v in m.items() if k != "gaps_s"} for m in metrics]
        scenario = {
            "system": system,
            "mode": spec.mode,
            "label": spec.label,
            "concurrency": spec.concurrency if spec.mode == "closed" else None,
            "rate": spec.rate if spec.mode == "open" else None,
            "format": fmt,
            "loadavg_1m_after": os.getloadavg()[0],
            "summary": summary,
            "streams": streams,
        }
        self.scenarios.append(scenario)
        t, e = summary["ttfa_s"], summary["errors"]
        print(
            f"bench: {system:14s} {spec.label:6s} {fmt:6s} streams={summary['streams']:4d} "
            f"ttfa p50={_s(t['p50'])} p90={_s(t['p90'])} rtf p50={_s(summary['rtf']['p50'])} "
            f"audio-s/s={summary['throughput']['steady_audio_s_per_wall_s']:.2f}"
            + (f" errors={e}" if e else ""),
            file=sys.stderr,
        )
        return scenario

    # --- servers -----------------------------------------------------------------

    def server_flags(self, *extra: str) -> list[str]:
        """``serve`` flags for a started server."""
        flags = ["--engine", self.args.engine]
        if self.args.model_dir is not None:
            flags += ["--model-dir", str(self.args.model_dir)]
        if self.args.threads:
            flags += ["--threads", str(self.args.threads)]
        return [*flags, *shlex.split(self.args.server_flags), *extra]

    async def measure_server(
        self, system: str, url: str | None, extra_flags: Sequence[str], formats: list[str]
    ) -> None:
        """Start (or reach) a server and run every load scenario in ``formats`` against it."""
        server: ServerProcess | None = None
        if url is None:
            command = shlex.split(self.args.server_cmd) or None
            server = ServerProcess(
                self.server_flags(*extra_flags), command=command, log_path=self.workdir / f"{system}.log"
            )
            print(f"bench: starting {system}: {shlex.join(server.argv)}", file=sys.stderr)
            await server.start()
            url = server.url
        try:
            hello = await fetch_hello(url)
            self.systems[system] = {
                "url": url,
                "hello": hello,
                "server": server.describe() if server else None,
            }
            offered = hello.get("formats", [])
            for fmt in formats:
                if fmt not in offered:
                    self.skip(f"{system} {fmt}", f"the server's hello.formats {offered} lacks it")
                    continue
                for spec in self.loads:
                    await self.run_scenario(system, url, spec, fmt, server)
        finally:
            if server is not None:
                code = await server.stop()
                self.systems[system]["server"]["exit_code"] = code if system in self.systems else None

    async def run_scenario(
        self, system: str, url: str, spec: LoadSpec, fmt: str, server: ServerProcess | None
    ) -> None:
        """One load scenario against ``url``."""
        frames = {"frame_ms": self.args.frame_ms} if self.args.frame_ms != 20 else {}
        options = StreamOptions(
            fmt=fmt,
            system=system,
            max_audio_s=self.args.max_audio_s,
            timeout_s=self.args.timeout_s,
            extra=frames,
        )

        async def runner(job: Any, stop: asyncio.Event) -> StreamRecord:
            return await run_stream(url, job, options, stop)

        variant = self.formats.index(fmt) if fmt in self.formats else 0
        spec = dataclasses.replace(spec, seed_base=seed_base(self.args.seed, spec.label, variant))
        cpu0 = server.cpu_s() if server else None
        client0 = time.process_time()  # the load client's own CPU: this process, every thread
        run = await run_load(self.texts, spec, runner)
        client = time.process_time() - client0
        cpu1 = server.cpu_s() if server else None
        cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
        self.add_scenario(system, spec, fmt, run.records, run, cpu, client)
        await asyncio.sleep(self.args.settle_s)  # let the server settle between scenarios

    # --- in-process baselines ----------------------------------------------------

    def baseline_args(self, concurrency: list[int]) -> list[str]:
        """Arguments shared by the in-process baseline children."""
        a = self.args
        return [
            "--model-dir", str(a.model_dir), "--concurrency", ",".join(map(str, concurrency)),
            "--duration", str(a.duration), "--max-streams", str(a.max_streams), "--texts", str(a.texts),
            "--text-sizes", a.text_sizes, "--text-langs", a.text_langs, "--seed", str(a.seed),
            "--max-audio-s", str(a.max_audio_s), "--threads", str(a.threads),
        ]  # fmt: skip

    async def measure_inprocess(
        self, system: str, module: str, concurrency: list[int], extra: list[str]
    ) -> None:
        """Run an in-process baseline child and add its scenarios."""
        if self.args.model_dir is None:
            self.skip(system, "needs --model-dir (a ChatTTS asset folder); the fake engine has no model")
            return
        if not concurrency:
            return
        out = self.workdir / f"{system}.json"
        log = self.workdir / f"{system}.log"
        print(f"bench: running {system} in-process (log {log})", file=sys.stderr)
        try:
            data = await inproc.run_child(module, [*self.baseline_args(concurrency), *extra], out, log)
        except RuntimeError as exc:
            self.skip(system, f"{exc}; last log lines: {_tail(log)}")
            return
        self.systems[system] = {"command": data["command"], "info": data["info"]}
        for sc in data["scenarios"]:
            records = [inproc.record_from_dict(r) for r in sc["records"]]
            run = LoadRun(records, sc["t_start"], sc["t_stop"], sc["t_end"])
            if sc.get("rate") is not None:
                spec = LoadSpec("open", rate=sc["rate"], **self._bounds())
            else:
                spec = LoadSpec("closed", concurrency=sc["concurrency"], **self._bounds())
            self.add_scenario(system, spec, "f32", records, run, sc["cpu_s"])
            if "engine_thread" in sc:  # the engine's steps, as a server's /metrics shows its own
                self.scenarios[-1]["engine_thread"] = sc["engine_thread"]

    # --- the run -----------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        """Measure everything the arguments ask for; returns the results."""
        a = self.args
        formats = [f for f in self.formats if f in DECODABLE_FORMATS]
        for f in self.formats:
            if f not in DECODABLE_FORMATS:
                self.skip(f"format {f}", f"the harness decodes only {', '.join(DECODABLE_FORMATS)}")
        machine = describe_machine()
        started = time.perf_counter()
        await self.measure_server("server", a.url, [], formats)
        if "b1" in self.baselines:
            if a.url is not None and a.baseline_url is None:
                self.skip("server-b1", "--url was given without --baseline-url (a server with --max-batch 1)")
            else:
                await self.measure_server("server-b1", a.baseline_url, ["--max-batch", "1"], formats[:1])
        closed = [s.concurrency for s in self.loads if s.mode == "closed"]
        rates = [s.rate for s in self.loads if s.mode == "open"]
        if "infer" in self.baselines:
            extra = ["--rates", ",".join(f"{r:g}" for r in rates)] if rates else []
            await self.measure_inprocess("chattts-infer", "bench.baselines.infer", closed, extra)
        if "engine" in self.baselines:
            engine_c = [int(c) for c in _csv(a.engine_concurrency)]
            await self.measure_inprocess("engine-direct", "bench.baselines.engine", engine_c, [])
        machine["loadavg_at_end"] = list(os.getloadavg())
        results = {
            "schema": 1,
            "title": a.title or "chattts-stream benchmark",
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": shlex.join(["python", "-m", "bench", *self.argv]),
            "elapsed_s": time.perf_counter() - started,
            "machine": machine,
            "settings": {
                **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
                "jitter_ms": self.jitter_ms,
                "child_env": dict(CHILD_ENV),
                "texts_used": len(self.texts),
            },
            "systems": self.systems,
            "skipped": self.skipped,
            "scenarios": self.scenarios,
        }
        results["issue4"] = throughput_ratios(
            results, 8 if 8 in closed else max(closed, default=1), formats[0] if formats else "pcm16"
        )
        return results


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 5)
    if isinstance(value, list):
        return [_round(v) for v in value]
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    return value


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"
