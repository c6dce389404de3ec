"""``python -m bench.cpu``: issue #23's CPU comparison, every row in one run.

::

    python -m server make-dev-model --size full /tmp/dev-full
    mkdir /tmp/before && git archive d178f8d | tar -x -C /tmp/before      # the code before #23
    python -m bench.cpu --model-dir /tmp/dev-full --before /tmp/before --before-commit d178f8d \\
        --out bench/results/cpu/<hw>

1. **step** (:mod:`bench.cpu.step`, one child process): the memory floor, the GPT's 140
   products in each form, transformers' own ``LlamaModel``, and the engine's token step
   with its projections as before #23 (``dense``), as now (``onednn-bf16``), with
   ``--quantize int8`` and with ``--quantize w8a8``, at batch 1, 4 and 8, interleaved
   rounds, each split by part and profiled op by op; with ``--step-compiled FORMS`` also the
   engine's compiled step in those forms (timed after the others, each on a fresh load);
2. **servers**: ``serve`` from ``--before`` (the code before the change, default flags),
   from this tree (default flags), with ``--quantize int8``, with ``--quantize w8a8``,
   with ``--compile-step on`` and with it and int8, each
   measured by the harness of ``python -m bench`` in closed loops at 1, 4 and 8 streams
   (pcm16, medium and long texts so that streams last several seconds, cut after
   ``--max-audio-s``); ``--rounds`` > 1 repeats the servers with their order flipped;
3. **in-process**: ChatTTS's own ``infer()`` (stock float32) and the engine stepping in
   this process (``bench.baselines.engine``: default, int8, w8a8, and each compiled) at the same levels;
4. **ratio** (not in the default parts): each of ``--ratio-systems`` against its engine
   in-process at ``--ratio-concurrency`` (8), interleaved over ``--ratio-rounds``: server then
   engine, then engine then server, … (one server process for every round; a fresh engine
   child each round; the same jobs and seeds every time), so that a drift of the machine
   falls on both sides. The report's target row for the ratio then uses the means of these
   rounds instead of two single runs. A 2-round run of the compiled w8a8 pair takes ~20 min::

       python -m bench.cpu --model-dir /tmp/dev-full --parts ratio --out X

Every result records the 1-minute load average after it (the machine is shared). Writes
``OUT.json`` (everything, every stream) and ``OUT.md`` (:mod:`bench.cpu.report`) after each
part, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cpu.report import SERVER_ENGINE, render
from bench.harness.machine import describe_machine, result_stem
from bench.harness.servers import CHILD_ENV, REPO_ROOT, ServerProcess, engine_thread_figures, scrape_metrics
from server.config import OPENMP_VARIABLES, Settings
from server.engine.flags import thread_environment

#: name → (extra ``serve`` flags, whose code: ``"before"`` or ``"after"``).
#: ``after`` is this tree's default flags, what a fresh clone's ``serve`` runs (``--profile
#: realtime``: on an x86-64 CPU the compiled w8a8 step, minutes of warm-up); the others name the
#: step flags they differ in (``--profile eager``: nothing compiled or quantized, the default
#: before ``--profile``).
SYSTEMS: dict[str, tuple[list[str], str]] = {
    "before": ([], "before"),
    "after": ([], "after"),
    "after-eager": (["--profile", "eager"], "after"),
    "after-int8": (["--profile", "eager", "--quantize", "int8"], "after"),
    "after-w8a8": (["--profile", "eager", "--quantize", "w8a8"], "after"),
    "after-compiled": (["--compile-step", "on", "--quantize", "none"], "after"),  # minutes of warm-up
    "after-compiled-int8": (["--compile-step", "on", "--quantize", "int8"], "after"),
    "after-compiled-w8a8": (["--compile-step", "on", "--quantize", "w8a8"], "after"),
    "before-compiled-w8a8": (["--compile-step", "on", "--quantize", "w8a8"], "before"),
}
#: The in-process engine each server is compared with at c8: name → its extra flags.
ENGINES: dict[str, list[str]] = {
    "engine-direct": [],
    "engine-direct-int8": ["--quantize", "int8"],
    "engine-direct-w8a8": ["--quantize", "w8a8"],
    "engine-direct-compiled": ["--compile-step", "on"],
    "engine-direct-compiled-int8": ["--compile-step", "on", "--quantize", "int8"],
    "engine-direct-compiled-w8a8": ["--compile-step", "on", "--quantize", "w8a8"],
}


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m bench.cpu`` arguments."""
    p = argparse.ArgumentParser(
        prog="python -m bench.cpu",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--model-dir", type=Path, required=True, help="full-size dev model (make-dev-model)")
    p.add_argument("--make-model", action="store_true", help="write a full-size dev model there if missing")
    p.add_argument("--before", type=Path, help="a checkout of the code before #23 (omit: no 'before' server)")
    p.add_argument("--before-commit", default="", help="the commit in --before if it is no git checkout")
    p.add_argument("--after-commit", default="", help="the commit of this tree if it is no git checkout")
    p.add_argument("--threads", type=int, default=2, help="torch threads of every system")
    p.add_argument("--parts", default="step,servers,inprocess", help="which parts to run")
    p.add_argument(
        "--engines", default=",".join(["chattts-infer", *ENGINES]), help="which in-process systems to measure"
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help="which servers to measure")
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument(
        "--block-schedule", default="", help="every server's and in-process engine's (default: their own)"
    )
    p.add_argument("--duration", type=float, default=40.0, help="load time of one server scenario, s")
    p.add_argument("--max-audio-s", type=float, default=6.0, help="each stream is cut after this much audio")
    p.add_argument("--text-sizes", default="medium,long", help="texts of the default set to use")
    p.add_argument("--rounds", type=int, default=1, help="server rounds (order flipped each round)")
    p.add_argument(
        "--ratio-systems",
        default="after-compiled-w8a8",
        help="servers of part 'ratio' (each against its engine)",
    )
    p.add_argument("--ratio-rounds", type=int, default=2, help="rounds of part 'ratio' (order flipped each)")
    p.add_argument("--ratio-concurrency", type=int, default=8, help="the level of part 'ratio'")
    p.add_argument("--step-rounds", type=int, default=3, help="rounds of the step part")
    p.add_argument("--step-length", type=int, default=256, help="attention length of the step part")
    p.add_argument("--step-batches", default="1,4,8", help="batch sizes of the step part")
    p.add_argument("--step-iterations", type=int, default=8, help="calls per timed run of the step part")
    p.add_argument("--compile", action="store_true", help="the step part also compiles transformers' Llama")
    p.add_argument(
        "--step-compiled",
        default="",
        help="the step part also times the compiled step: bf16, int8, w8a8, w8a8-ahead, w8a8-fbgemm-ahead",
    )
    p.add_argument("--out", type=Path, default=result_stem("cpu"))
    return p


class Run:
    """Settings, the results so far, and writing them after every part."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.args = args
        self.workdir = Path(tempfile.mkdtemp(prefix="cpu-realtime-"))
        self.began = time.perf_counter()
        self.result: dict[str, Any] = {
            "command": shlex.join(["python", "-m", "bench.cpu", *argv]),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": describe_machine(),
            "openmp_env": {k: CHILD_ENV[k] for k in OPENMP_VARIABLES if k in CHILD_ENV},
            "commits": {"after": args.after_commit or _commit(REPO_ROOT)},
            "step": None,
            "systems": {},
            "scenarios": [],
            "ratio_scenarios": [],  # part 'ratio', each tagged with its round
            "skipped": [],
        }
        if args.before is not None:
            self.result["commits"]["before"] = args.before_commit or _commit(args.before)

    def write(self) -> None:
        """JSON and markdown of everything so far."""
        self.result["elapsed_s"] = round(time.perf_counter() - self.began, 1)
        self.result["machine"]["loadavg_now"] = list(os.getloadavg())
        out = self.args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.result, indent=1, ensure_ascii=False) + "\n"
        out.with_name(out.name + ".json").write_text(text)
        out.with_name(out.name + ".md").write_text(render(self.result))

    def step(self) -> None:
        """The step part, in a child process."""
        a, out = self.args, self.workdir / "step.json"
        argv = [
            sys.executable, "-m", "bench.cpu.step", "--model-dir", str(a.model_dir),
            "--threads", str(a.threads), "--rounds", str(a.step_rounds), "--length", str(a.step_length),
            "--batches", a.step_batches, "--iterations", str(a.step_iterations), "--out", str(out),
        ]  # fmt: skip
        argv += ["--compile"] if a.compile else []
        argv += ["--compiled-step", a.step_compiled] if a.step_compiled else []
        print(f"[cpu_realtime] step: {shlex.join(argv)}", flush=True)
        proc = subprocess.run(argv, cwd=REPO_ROOT, env={**os.environ, **CHILD_ENV}, check=False)
        if proc.returncode != 0:
            self.result["skipped"].append({"what": "step", "why": f"bench.cpu.step exited {proc.returncode}"})
            return
        self.result["step"] = {"command": shlex.join(argv), **json.loads(out.read_text())}

    def harness(self, concurrency: str | None = None) -> Any:
        """The ``python -m bench`` harness with this run's load settings (at ``concurrency``: one level)."""
        from bench.harness.cli import build_parser as bench_parser
        from bench.harness.run import Harness

        a = self.args
        levels = concurrency or a.concurrency
        bench_argv = [
            "--model-dir", str(a.model_dir), "--threads", str(a.threads), "--formats", "pcm16",
            "--concurrency", levels, "--duration", str(a.duration), "--grace-s", "60",
            "--timeout-s", "240", "--max-audio-s", str(a.max_audio_s), "--text-sizes", a.text_sizes,
            "--jitter-ms", "100,300", "--engine-concurrency", levels, "--settle-s", "2",
        ]  # fmt: skip
        return Harness(bench_parser().parse_args(bench_argv), bench_argv)

    async def servers(self, harness: Any) -> None:
        """Every server system, each started fresh, in flipped order every round."""
        a = self.args
        names = [n for n in a.systems.split(",") if n in SYSTEMS]
        if a.before is None and "before" in names:
            names.remove("before")
            self.result["skipped"].append({"what": "server before", "why": "no --before checkout given"})
        for r in range(a.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                extra, code = SYSTEMS[name]
                await self._serve(harness, name, extra, a.before if code == "before" else REPO_ROOT, r)
                self.result["scenarios"] = harness.scenarios
                self.write()

    async def _serve(self, harness: Any, name: str, extra: list[str], cwd: Path, round_: int) -> None:
        server = await self._start_server(harness, name, extra, cwd, round_)
        if server is None:
            return
        try:
            await _measure(harness, name, server)
        finally:
            await server.stop()

    async def _start_server(
        self, harness: Any, name: str, extra: list[str], cwd: Path, round_: int
    ) -> ServerProcess | None:
        """``serve`` with ``extra`` flags, started and described in the results (None: it failed)."""
        from bench.harness.client import fetch_hello

        flags = [*harness.server_flags(), "--cache-bytes", "0", *extra, *self.schedule_flags()]
        server = ServerProcess(flags, log_path=self.workdir / f"{name}-{round_}.log", cwd=cwd)
        print(f"[cpu_realtime] server {name} #{round_}: {shlex.join(server.argv)}; in {cwd}", flush=True)
        try:
            await server.start(timeout_s=900)
        except RuntimeError as exc:
            self.result["skipped"].append({"what": f"server {name}", "why": str(exc)})
            return None
        try:
            hello = await fetch_hello(server.url)
        except BaseException:
            await server.stop()
            raise
        entry = {"hello": hello, "server": server.describe(), "cwd": str(cwd)}
        self.result["systems"].setdefault(name, []).append(entry)
        return server

    def schedule_flags(self) -> list[str]:
        """``--block-schedule`` for every server and in-process engine, when one is asked for."""
        return ["--block-schedule", self.args.block_schedule] if self.args.block_schedule else []

    async def inprocess(self, harness: Any) -> None:
        """ChatTTS's ``infer()`` and the engine in-process (default, int8, compiled)."""
        levels = [int(c) for c in self.args.concurrency.split(",")]
        wanted = self.args.engines.split(",")
        if "chattts-infer" in wanted:
            await harness.measure_inprocess("chattts-infer", "bench.baselines.infer", levels, [])
        engines = [n for n in wanted if n in ENGINES]
        for name in engines:
            extra = [*ENGINES[name], *self.schedule_flags()]
            await harness.measure_inprocess(name, "bench.baselines.engine", levels, extra)
        for name in ("chattts-infer", *engines):
            if name in harness.systems:
                self.result["systems"][name] = [harness.systems[name]]
        self.result["skipped"] += harness.skipped
        self.result["scenarios"] = harness.scenarios

    async def ratio(self) -> None:
        """Part 'ratio': each server and its engine in-process, interleaved (see the module's doc)."""
        a = self.args
        level = a.ratio_concurrency
        harness = self.harness(str(level))
        for name in a.ratio_systems.split(","):
            engine = SERVER_ENGINE.get(name)  # every server it names is one of this tree's SYSTEMS
            if engine is None:
                self.result["skipped"].append(
                    {"what": f"ratio {name}", "why": "no engine in-process to match"}
                )
                continue
            server = await self._start_server(harness, name, SYSTEMS[name][0], REPO_ROOT, 0)
            if server is None:
                continue
            try:
                for round_, side in interleaved(a.ratio_rounds):
                    taken = len(harness.scenarios)
                    if side == "server":
                        await _measure(harness, name, server)
                    else:
                        extra = [*ENGINES[engine], *self.schedule_flags()]
                        await harness.measure_inprocess(engine, "bench.baselines.engine", [level], extra)
                    for scenario in harness.scenarios[taken:]:
                        scenario["ratio_round"] = round_
                    self.result["ratio_scenarios"] = harness.scenarios
                    self.write()
            finally:
                await server.stop()
            if engine in harness.systems:
                self.result["systems"].setdefault(engine, []).append(harness.systems[engine])
        self.result["skipped"] += harness.skipped


def interleaved(rounds: int) -> list[tuple[int, str]]:
    """(round, side) in the order part 'ratio' runs them: server first in even rounds, engine in odd."""
    order: list[tuple[int, str]] = []
    for r in range(rounds):
        sides = ("server", "engine") if r % 2 == 0 else ("engine", "server")
        order += [(r, side) for side in sides]
    return order


async def _measure(harness: Any, name: str, server: ServerProcess) -> None:
    """The harness's loads against ``server``, each with the inference thread's figures around it.

    Is the server's step as fast as its engine's in-process, and is the thread stepping all the time?
    """
    metrics_url = f"http://127.0.0.1:{server.port}/metrics"
    for spec in harness.loads:
        before, began = await _scrape(metrics_url), time.perf_counter()
        await harness.run_scenario(name, server.url, spec, "pcm16", server)
        after = await _scrape(metrics_url)
        if before is not None and after is not None:
            figures = engine_thread_figures(before, after, time.perf_counter() - began)
            harness.scenarios[-1]["engine_thread"] = figures


async def _scrape(url: str) -> dict[str, float] | None:
    """The server's ``/metrics`` samples, or None (logged) where it has none to give."""
    try:
        return await asyncio.to_thread(scrape_metrics, url)
    except (OSError, ValueError) as exc:
        print(f"[cpu_realtime] no metrics from {url}: {exc}", flush=True)
        return None


def _commit(root: Path) -> str:
    argv = ["git", "-C", str(root), "rev-parse", "--short", "HEAD"]
    head = subprocess.run(argv, capture_output=True, text=True, check=False).stdout.strip()
    return head or f"(not a git checkout: {root})"


def main(argv: list[str] | None = None) -> int:
    """Run the parts asked for; write the results after each."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    # Every system, servers and in-process engines alike, waits as a server started here
    # would by default (or as this environment says): the ratios compare code, not settings.
    CHILD_ENV.update(thread_environment(Settings()))
    CHILD_ENV.update({k: os.environ[k] for k in OPENMP_VARIABLES if k in os.environ})
    if args.make_model and not (args.model_dir / "DEV_MODEL.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "server", "make-dev-model", "--size", "full", str(args.model_dir)],
            cwd=REPO_ROOT,
            check=True,
        )
    run = Run(args, argv)
    parts = set(args.parts.split(","))
    if "step" in parts:
        run.step()
        run.write()
    harness = run.harness()
    if "servers" in parts:
        asyncio.run(run.servers(harness))
    if "inprocess" in parts:
        asyncio.run(run.inprocess(harness))
    if "ratio" in parts:
        asyncio.run(run.ratio())
    run.result["skipped"] = list({json.dumps(s): s for s in run.result["skipped"]}.values())
    run.write()
    print(render(run.result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
