"""Where the server's threads run on a small CPU (issue #23): placements end to end, in interleaved rounds.

On two cores the event loop, the inference thread and torch's threads compete. Each system
here is kept loaded for the whole run: the server under several placements (``serve``
subprocesses differing in ``--threads``, ``OMP_WAIT_POLICY`` and the audio format, i.e.
whether Opus is encoded in the encoder pool), and the engine stepping in-process
(:class:`bench.baselines.engine.ClosedLoop` in a long-lived child, one per thread count), the
ceiling a server could reach. Every round runs each system once, in a rotated order, as one
closed-loop scenario of ``--concurrency`` streams for ``--seconds`` through the harness of
``python -m bench`` (:mod:`bench.harness.client`, :mod:`bench.harness.load`,
:mod:`bench.harness.stats`), so a busy
shared machine slows every system alike; the report gives each system's medians over the
rounds and its ratio to the in-process engine taken round by round.

    python -m bench.studies.placement --model-dir DIR --rounds 4 \\
        --out bench/results/studies/placement-threads-<hw>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.harness import inproc
from bench.harness.client import StreamOptions, run_stream
from bench.harness.engine_bench import command
from bench.harness.latency import stream_metrics
from bench.harness.load import LoadRun, LoadSpec, run_load
from bench.harness.machine import describe_machine
from bench.harness.servers import REPO_ROOT, ServerProcess, child_env
from bench.harness.stats import summarize
from bench.harness.textset import DEFAULT_TEXTS, load_texts, seed_base
from server.config import OPENMP_VARIABLES, Settings
from server.engine.flags import thread_environment

#: name → (serve flags, environment beyond the harness's (its OpenMP variables left out), audio format).
#: The server sets GOMP_SPINCOUNT itself (``--omp-wait-policy auto``: a short spin); libgomp's own
#: default is 300000 spins (about 3 ms) before an idle thread sleeps.
SERVERS: dict[str, tuple[list[str], dict[str, str], str]] = {
    "server t2 spin": (["--threads", "2"], {}, "pcm16"),
    "server t2 passive": (["--threads", "2", "--omp-wait-policy", "passive"], {}, "pcm16"),
    "server t2 libgomp-default": (["--threads", "2"], {"GOMP_SPINCOUNT": "300000"}, "pcm16"),
    "server t2 active": (["--threads", "2", "--omp-wait-policy", "active"], {}, "pcm16"),
    "server t1 passive": (["--threads", "1", "--omp-wait-policy", "passive"], {}, "pcm16"),
    "server t1 pinned": (["--threads", "1", "--engine-cpus", "1"], {}, "pcm16"),
    "server t2 passive opus": (["--threads", "2", "--omp-wait-policy", "passive"], {}, "opus"),
}
#: name → (torch threads of the in-process engine, CPUs it may run on: 0 = all); each waits as
#: the server does by default (:func:`server.engine.flags.thread_environment`).
ENGINES = {"engine t2": (2, 0), "engine t1": (1, 0), "engine t1 one-core": (1, 1)}
REFERENCE = "engine t2"


def _env(extra: dict[str, str]) -> dict[str, str]:
    return {**{k: v for k, v in child_env().items() if k not in OPENMP_VARIABLES}, **extra}


class EngineChild:
    """A child process holding a warmed-up engine; runs one closed-loop scenario per command."""

    def __init__(self, name: str, threads: int, cpus: int, args: argparse.Namespace, log: Path) -> None:
        self.name, self.threads, self.cpus, self.args, self.log = name, threads, cpus, args, log
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        argv = [
            sys.executable,
            "-m",
            "bench.studies.placement",
            "--engine-child",
            "--threads",
            str(self.threads),
        ]
        argv += ["--cpus", str(self.cpus)]
        argv += ["--model-dir", str(self.args.model_dir), "--texts", str(self.args.texts)]
        argv += ["--text-sizes", self.args.text_sizes, "--out", "-"]
        with open(self.log, "ab") as log:  # noqa: ASYNC230 (once, before the measurement)
            self.proc = await asyncio.create_subprocess_exec(
                *argv, cwd=REPO_ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=log, env=_env(thread_environment(Settings(), {})),
            )  # fmt: skip
        await self._answer()

    async def _answer(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited (see {self.log})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def scenario(self, concurrency: int, seconds: float, base_seed: int) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(
            json.dumps({"n": concurrency, "seconds": seconds, "seed": base_seed}).encode() + b"\n"
        )
        await self.proc.stdin.drain()
        return await self._answer()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                async with asyncio.timeout(30):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


def engine_child(args: argparse.Namespace) -> None:
    """The child: load, warm up, say ready, then one scenario per stdin line (JSON in, JSON out)."""
    import torch

    from bench.baselines.engine import ClosedLoop
    from server.engine.chattts.engine import ChatTTSEngine

    if args.cpus:  # before torch starts its threads: they inherit this thread's CPUs
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.cpus])
    torch.set_num_threads(args.threads)
    engine = ChatTTSEngine.load(model_dir=args.model_dir, device="cpu")
    engine.warmup()
    texts = load_texts(args.texts, sizes=tuple(s for s in args.text_sizes.split(",") if s))
    steps = {"tokens": 0.0, "step_s": 0.0}
    step = engine.step

    def counted(seq_ids: list[int]) -> Any:  # what the server's /metrics counts, counted here
        began = time.perf_counter()
        results = step(seq_ids)
        steps["step_s"] += time.perf_counter() - began
        steps["tokens"] += sum(r.tokens for r in results)
        return results

    engine.step = counted  # type: ignore[method-assign]
    loop = ClosedLoop(engine, texts, max_tokens=inproc.cap_tokens(0.0), segment_max_chars=120)
    print(json.dumps({"ready": True, "dtype": engine.info.extra.get("dtype")}), flush=True)
    for line in sys.stdin:
        command_ = json.loads(line)
        cpu0 = inproc.cpu_now()
        steps.update(tokens=0.0, step_s=0.0)
        run = loop.run(command_["n"], command_["seconds"], base_seed=command_["seed"], cut=True)
        result = inproc.scenario_result(command_["n"], run, inproc.cpu_now() - cpu0)
        result["engine"] = {**steps, "wall_s": run.t_end - run.t_start}
        print(json.dumps(result), flush=True)
    engine.close()


def _thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each of a process's threads (Linux ``/proc``), by thread id."""
    ticks, out = os.sysconf("SC_CLK_TCK"), {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def _engine_counters(port: int) -> dict[str, float]:
    """The server's token counter and block time (its engine's work) from ``/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    names = {"chattts_tokens_generated_total": "tokens", "chattts_block_seconds_sum": "step_s"}
    return {names[k]: float(v) for k, _, v in (line.partition(" ") for line in lines) if k in names}


def _summary(
    records: list[Any], run: LoadRun, cpu_s: float | None, engine: dict[str, float] | None = None
) -> dict[str, Any]:
    metrics = [stream_metrics(r, [300.0]) for r in records]
    s = summarize(records, metrics, t_start=run.t_start, t_stop=run.t_stop, t_end=run.t_end, cpu_s=cpu_s)
    work = engine or {}
    return {
        # The engine's own pace (tokens per second of stepping) and how much of the scenario it stepped.
        "tokens_per_step_s": work["tokens"] / work["step_s"] if work.get("step_s") else None,
        "stepping": work["step_s"] / work["wall_s"] if work.get("wall_s") else None,
        "loop_cores": work.get("loop_cores"),  # the server's main (event-loop) thread, cores used
        "audio_s_per_wall_s": s["throughput"]["steady_audio_s_per_wall_s"],
        "audio_s_per_cpu_s": s["throughput"].get("audio_s_per_cpu_s"),
        "ttfa_p50": s["ttfa_s"]["p50"],
        "rtf_p50": s["rtf"]["p50"],
        "streams": s["streams"],
        "errors": s["errors"],
    }


async def run_server(
    server: ServerProcess, fmt: str, concurrency: int, args: argparse.Namespace, base: int
) -> dict[str, Any]:
    texts = load_texts(args.texts, sizes=tuple(s for s in args.text_sizes.split(",") if s))
    spec = LoadSpec("closed", concurrency=concurrency, duration_s=args.seconds, grace_s=1.0, seed_base=base)
    options = StreamOptions(fmt=fmt, system="server")
    assert server.proc is not None
    pid = server.proc.pid
    cpu0, threads0 = server.cpu_s(), _thread_cpu_s(pid)
    work0 = await asyncio.to_thread(_engine_counters, server.port)
    run = await run_load(texts, spec, lambda job, stop: run_stream(server.url, job, options, stop))
    cpu1, threads1 = server.cpu_s(), _thread_cpu_s(pid)
    work1 = await asyncio.to_thread(_engine_counters, server.port)
    wall = run.t_end - run.t_start
    engine = {k: work1[k] - work0.get(k, 0.0) for k in work1}
    engine |= {"wall_s": wall, "loop_cores": (threads1.get(pid, 0.0) - threads0.get(pid, 0.0)) / wall}
    cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    return _summary(run.records, run, cpu, engine)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def render(report: dict[str, Any]) -> str:
    """The markdown table: per load and system, medians over rounds and the paired ratio to the reference."""
    rounds = report["rounds"]
    m = report["machine"]
    loads = ", ".join(f"{r['loadavg'][0]:.1f}" for r in rounds)
    reference = report.get("reference", REFERENCE)
    lines = [
        "# Placements of the server's threads on a 2-core CPU (issue #23)",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {m.get('cpu_model')} ({m.get('cpu_cores')} cores), torch {m['versions'].get('torch')}; "
        f"{len(rounds)} rounds, each system once per round in a rotated order, closed loop of "
        f"{'/'.join(map(str, report['concurrency']))} streams for {report['seconds']:.0f} s each; load "
        f'average per round {loads}. "per stream" is audio-s per wall-s over the streams: a stream '
        "plays in real time when it is above 1.",
        "",
        f"| load | system | audio-s per wall-s (median) | per stream | × {reference} (median of rounds, "
        "range) | audio-s per CPU-s | time to first audio p50 (s) | RTF p50 | engine tokens per step-s "
        "| stepping (share of the scenario) | event-loop thread (cores) | streams (errors) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in report["concurrency"]:
        lines += [_row(rounds, f"c{n}", n, name, reference) for name in report["systems"]]
    return "\n".join(lines) + "\n"


def _row(rounds: list[dict[str, Any]], label: str, n: int, name: str, reference: str) -> str:
    results = [r["results"].get(label, {}) for r in rounds]
    runs = [res[name] for res in results if name in res]
    ratios = [
        res[name]["audio_s_per_wall_s"] / res[reference]["audio_s_per_wall_s"]
        for res in results
        if name in res and reference in res and res[reference]["audio_s_per_wall_s"]
    ]
    ratio = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})" if ratios else "—"
    keys = ("audio_s_per_wall_s", "audio_s_per_cpu_s", "ttfa_p50", "rtf_p50", "tokens_per_step_s", "stepping")
    cells = [_median([x.get(k) for x in runs]) for k in (*keys, "loop_cores")]
    text = ["—" if c is None else f"{c:.3f}" if i == 6 else f"{c:.2f}" for i, c in enumerate(cells)]
    per_stream = "—" if cells[0] is None else f"{cells[0] / n:.2f}"
    errors = sum(sum(x["errors"].values()) for x in runs)
    streams = sum(x["streams"] for x in runs)
    return (
        f"| {label} | {name} | {text[0]} | {per_stream} | {ratio} | {text[1]} | {text[2]} | {text[3]} "
        f"| {text[4]} | {text[5]} | {text[6]} | {streams} ({errors}) |"
    )


async def main_async(args: argparse.Namespace) -> None:
    report: dict[str, Any] = {
        "command": command("bench.studies.placement"),
        "machine": describe_machine(),
        "concurrency": args.concurrency,
        "seconds": args.seconds,
        "reference": args.reference,
        "rounds": [],
    }
    logs = Path(tempfile.mkdtemp(prefix=f"{args.out.name}-logs-"))  # the servers' logs, kept out of results
    print(f"logs in {logs}", file=sys.stderr)
    servers = {n: v for n, v in SERVERS.items() if n in args.systems}
    engines = {n: v for n, v in ENGINES.items() if n in args.systems}
    report["systems"] = [*servers, *engines]
    started: dict[str, ServerProcess] = {}
    children: dict[str, EngineChild] = {}
    try:
        for name, (flags, extra, _) in servers.items():
            server = ServerProcess(
                ["--model-dir", str(args.model_dir), *flags], env=_env(extra), log_path=logs / f"{name}.log"
            )
            print(f"placement: starting {name}", file=sys.stderr)
            await server.start(timeout_s=900)
            started[name] = server
        for name, (threads, cpus) in engines.items():
            print(f"placement: starting {name}", file=sys.stderr)
            child = EngineChild(name, threads, cpus, args, logs / f"{name}.log")
            await child.start()
            children[name] = child
        names = report["systems"]
        for index in range(args.rounds):
            order = names[index % len(names) :] + names[: index % len(names)]
            results: dict[str, dict[str, Any]] = {}
            for n in args.concurrency:
                base = seed_base(args.seed, f"round{index}c{n}")
                here = results[f"c{n}"] = {}
                for name in order:
                    if name in started:
                        here[name] = await run_server(started[name], servers[name][2], n, args, base)
                    else:
                        sc = await children[name].scenario(n, args.seconds, base)
                        records = [inproc.record_from_dict(r) for r in sc["records"]]
                        run = LoadRun(records, sc["t_start"], sc["t_stop"], sc["t_end"])
                        here[name] = _summary(records, run, sc["cpu_s"], sc.get("engine"))
                    print(f"placement: round {index} c{n} {name}: {here[name]}", file=sys.stderr)
            report["rounds"].append(
                {"order": order, "loadavg": os.getloadavg(), "results": results, "t": time.time()}
            )
            args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
            args.out.with_suffix(".md").write_text(render(report))
    finally:
        for server in started.values():
            await server.stop()
        for child in children.values():
            await child.stop()
    print(render(report))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model-dir", type=Path, required=True, help="full-size model (make-dev-model --size full)")
    add(
        "--systems",
        default=",".join([*SERVERS, *ENGINES]),
        help="which of the systems to run (comma-separated)",
    )
    add("--rounds", type=int, default=4)
    add("--seconds", type=float, default=30.0, help="each scenario's load window")
    add("--concurrency", default="8", help="closed-loop loads, streams in flight (comma-separated)")
    add("--reference", default=REFERENCE, help="the system every other is divided by, round by round")
    add("--texts", type=Path, default=DEFAULT_TEXTS)
    add("--text-sizes", default="short", help="one segment each: every system does the same work per stream")
    add("--seed", type=int, default=1)
    add("--threads", type=int, default=2, help=argparse.SUPPRESS)
    add("--cpus", type=int, default=0, help=argparse.SUPPRESS)
    add("--engine-child", action="store_true", help=argparse.SUPPRESS)
    add("--out", type=Path, required=True, help="path without suffix: writes .json and .md")
    args = parser.parse_args()
    args.systems = [s.strip() for s in args.systems.split(",")]
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    if args.engine_child:
        engine_child(args)
        return
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
