"""``python -m bench.gpu``: the one-command GPU check (issue #15).

On a CUDA machine, in under 9 minutes by default (``--budget-s``)::

    python -m bench.gpu                      # writes bench/results/gpu/<gpu>.json and .md (e.g. h200)

1. **tests**: the model tests (``tests/model``) with the engine on the device
   (``CHATTTS_TEST_DEVICE``);
2. **step**: token-step time per batch bucket, CUDA graphs on and off (:mod:`bench.gpu.step`);
   **engine**: the engine alone in-process at the server scenarios' levels, the ceiling each
   scenario is compared with (:mod:`bench.gpu.engine`, per ``--engine-schedules`` entry);
3. **ttfa**: a server with the full-size dev model (``--max-batch`` slots), time to first
   audio p50/p99 at 1, 16 and 64 concurrent streams (the harness of ``python -m bench``);
4. **search**: the largest number of concurrent streams that all play with zero underruns
   in the harness's simulated listener (buffer ``--listener-ms``), on the same server;
5. the results, naming GPU, driver, torch and CUDA, after every stage (a failed or
   timed-out stage is recorded and the next one runs).

``python -m bench.gpu --device cpu --smoke`` runs the same stages with the tiny model and
tiny sizes in well under a minute (CI runs it, so the command cannot rot).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu.model_tests import stage_tests
from bench.gpu.report import render, verdicts
from bench.harness.machine import describe_machine
from bench.harness.servers import REPO_ROOT, ServerProcess, engine_thread_figures, scrape_metrics

STAGES = ("tests", "step", "engine", "ttfa", "search")


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m bench.gpu`` arguments."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="torch device of the engine (cuda, cuda:1, cpu)")
    p.add_argument("--smoke", action="store_true", help="tiny model and sizes: seconds, for CI")
    p.add_argument(
        "--model-dir", type=Path, help="ChatTTS assets (default: a full-size dev model, made once)"
    )
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "chattts-stream")
    p.add_argument(
        "--budget-s", type=float, help="total time; stages get what is left (default 540, smoke 300)"
    )
    p.add_argument("--max-batch", type=int, default=128, help="the server's KV slots (and search ceiling)")
    p.add_argument("--ttfa-concurrency", default="1,16,64")
    p.add_argument("--listener-ms", type=float, default=300.0, help="simulated listener's buffer")
    p.add_argument("--scenario-s", type=float, default=12.0, help="load time of one server scenario")
    p.add_argument("--max-audio-s", type=float, default=8.0, help="each stream is cut after this much audio")
    p.add_argument("--stages", default=",".join(STAGES), help="which stages to run")
    p.add_argument(
        "--engine-schedules",
        default="default",
        help="block schedules the engine stage runs, ';'-separated ('default': the engine's own), "
        "e.g. 'default;8,16,20,24,32'",
    )
    p.add_argument("--engine-seconds", type=float, default=6.0, help="each closed loop of the engine stage")
    p.add_argument("--tests-cap-s", type=float, default=170.0, help="most seconds of the tests stage")
    p.add_argument(
        "--test-workers",
        type=int,
        help="pytest-xdist processes for the model tests, a test file each (default 8 on a GPU, where "
        "all of tests/model took 110 s in 12 instead of not finishing in 170 s in one; 0: one process)",
    )
    p.add_argument(
        "--out", type=Path, help="output prefix (default bench/results/gpu/<device name>, e.g. h200)"
    )
    return p


def apply_smoke(args: argparse.Namespace) -> None:
    """Tiny model, two-row buckets, one-second scenarios."""
    args.max_batch, args.ttfa_concurrency = 4, "1,2"
    args.scenario_s, args.max_audio_s, args.engine_seconds = 1.0, 1.0, 1.0


def versions(device: str) -> dict[str, Any]:
    """torch, CUDA, cuDNN and the device's name (imports torch; the stages run in child processes)."""
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        out["gpu"] = torch.cuda.get_device_name(index)
        out["cudnn"] = torch.backends.cudnn.version()
        out["gpu_memory_gib"] = round(torch.cuda.get_device_properties(index).total_memory / 2**30, 1)
    else:
        out["gpu"] = None
    return out


def slug(text: str) -> str:
    """``NVIDIA H200`` → ``nvidia-h200``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


class Run:
    """The budget, the results so far, and writing them after every stage."""

    def __init__(self, args: argparse.Namespace, argv: list[str], out: Path) -> None:
        self.args, self.out = args, out
        self.began = time.perf_counter()
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
        self.results: dict[str, Any] = {
            "command": shlex.join(["python", "-m", "bench.gpu", *argv]),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": describe_machine(),
            "stages": {},
        }

    def left(self) -> float:
        """Seconds of the budget left."""
        return self.args.budget_s - (time.perf_counter() - self.began)

    def stage(self, name: str, cap_s: float, body: Callable[[float], dict[str, Any]]) -> dict[str, Any]:
        """Run one stage with ``min(cap_s, budget left)`` seconds; record what it gave or why it failed."""
        limit = min(cap_s, self.left())
        print(
            f"[bench.gpu] stage {name}: up to {limit:.0f} s ({self.left():.0f} s of the budget left)",
            flush=True,
        )
        began = time.perf_counter()
        if limit < 5:
            entry: dict[str, Any] = {"status": "skipped", "why": "time budget spent"}
        else:
            try:
                entry = {"status": "ok", **body(limit)}
            except Exception as exc:  # a failed stage is a result; the next stage still runs
                entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        entry["elapsed_s"] = round(time.perf_counter() - began, 1)
        self.results["stages"][name] = entry
        print(f"[bench.gpu] stage {name}: {entry['status']} in {entry['elapsed_s']} s", flush=True)
        self.write()
        return entry

    def write(self) -> None:
        """JSON and markdown of everything so far."""
        self.results["elapsed_s"] = round(time.perf_counter() - self.began, 1)
        self.results["verdicts"] = verdicts(self.results)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.with_name(self.out.name + ".json").write_text(json.dumps(self.results, indent=1) + "\n")
        self.out.with_name(self.out.name + ".md").write_text(render(self.results))


def stage_step(args: argparse.Namespace, limit: float, workdir: Path) -> dict[str, Any]:
    """Token-step time per batch bucket (child process)."""
    out = workdir / "step.json"
    argv = [
        sys.executable, "-m", "bench.gpu.step", "--model-dir", str(args.model_dir), "--device", args.device,
        "--max-batch", str(args.max_batch), "--out", str(out),
    ]  # fmt: skip
    if args.smoke:
        argv += ["--iterations", "3"]
    data = run_child_json(argv, out, limit)
    data["command"] = shlex.join(argv)
    return data


def run_child_json(argv: list[str], result: Path, timeout: float) -> dict[str, Any]:
    """Run a ``python -m bench.…`` child and read the JSON it wrote; its stderr's end if it failed."""
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[2]} exited {proc.returncode}: {proc.stderr[-2000:]}")
    data: dict[str, Any] = json.loads(result.read_text())
    return data


def stage_engine(args: argparse.Namespace, limit: float, workdir: Path) -> dict[str, Any]:
    """The engine alone, in-process, at the server scenarios' levels (:mod:`bench.gpu.engine`).

    The ceiling each server scenario is compared with, in the same run (the first H200 run
    found the server at 0.37x its engine at 64 streams); once per ``--engine-schedules`` entry.
    """
    deadline = time.perf_counter() + limit
    levels = sorted({min(int(c), args.max_batch) for c in args.ttfa_concurrency.split(",")})
    runs: dict[str, Any] = {}
    for index, schedule in enumerate(args.engine_schedules.split(";")):
        out = workdir / f"engine-{index}"
        argv = [
            sys.executable, "-m", "bench.gpu.engine", "--model-dir", str(args.model_dir),
            "--device", args.device, "--max-batch", str(max(levels)),
            "--levels", ",".join(map(str, levels)), "--seconds", str(args.engine_seconds), "--out", str(out),
        ]  # fmt: skip
        if schedule.strip() != "default":
            argv += ["--block-schedule", schedule.strip()]
        if args.smoke:
            argv += ["--settle-s", "0.3", "--profile-blocks", "1", "--low", "8", "--span", "4"]
        data = run_child_json(argv, out.with_name(out.name + ".json"), deadline - time.perf_counter())
        runs[data["block_schedule"]] = {
            "command": shlex.join(argv),
            "default": schedule.strip() == "default",
            "load_and_warmup_s": data["ready"]["load_and_warmup_s"],
            **{key: data[key] for key in ("closed", "blocks", "block_tokens")},
        }
    return {"runs": runs}


class ServerStages:
    """One server (full-size dev model on the device) for the ttfa and search stages."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        from bench.harness.cli import build_parser
        from bench.harness.run import Harness

        self.args = args
        self.loop = asyncio.new_event_loop()
        grace = 5.0 if args.smoke else 30.0
        bench_argv = [
            "--formats", "pcm16", "--jitter-ms", f"100,{args.listener_ms:g}",
            "--duration", str(args.scenario_s),
            "--grace-s", str(grace), "--timeout-s", str(grace + 60), "--max-audio-s", str(args.max_audio_s),
            "--baselines", "", "--settle-s", "0.2",
        ]  # fmt: skip
        if args.smoke:
            bench_argv += ["--text-sizes", "short"]
        self.harness = Harness(build_parser().parse_args(bench_argv), bench_argv)
        flags = [
            "--engine", "chattts", "--model-dir", str(args.model_dir), "--device", args.device,
            "--max-batch", str(args.max_batch), "--max-queue", str(4 * args.max_batch), "--cache-bytes", "0",
        ]  # fmt: skip
        self.server = ServerProcess(flags, log_path=workdir / "server.log")
        self.probes: dict[int, dict[str, Any]] = {}

    def start(self, limit: float) -> dict[str, Any]:
        """Start the server (load, warm-up, graph capture) within ``limit`` seconds."""
        self.loop.run_until_complete(self.server.start(timeout_s=limit))
        return {"server": self.server.describe()}

    def probe(self, concurrency: int) -> dict[str, Any]:
        """One closed-loop scenario; the figures the report needs."""
        from bench.harness.load import LoadSpec

        a = self.args
        bounds = {
            "duration_s": a.scenario_s,
            "max_streams": 20 * concurrency,
            "grace_s": self.harness.args.grace_s,
        }
        spec = LoadSpec("closed", concurrency=concurrency, seed=1, **bounds)
        metrics_url = f"http://127.0.0.1:{self.server.port}/metrics"
        before, began = scrape_metrics(metrics_url), time.perf_counter()
        self.loop.run_until_complete(
            self.harness.run_scenario("server", self.server.url, spec, "pcm16", self.server)
        )
        engine = engine_thread_figures(before, scrape_metrics(metrics_url), time.perf_counter() - began)
        s = self.harness.scenarios[-1]["summary"]
        listener = {entry["threshold_ms"]: entry for entry in s["listener"]}
        held = listener.get(a.listener_ms, {"streams_with_underruns": None})
        result = {
            "concurrency": concurrency,
            "streams": s["streams"],
            "errors": s["errors"],
            "cut": s["cut"],
            "ttfa_p50_s": s["ttfa_s"]["p50"],
            "ttfa_p99_s": s["ttfa_s"]["p99"],
            "rtf_p50": s["rtf"]["p50"],
            "audio_s_per_wall_s": s["throughput"]["steady_audio_s_per_wall_s"],
            "underrun_streams": held["streams_with_underruns"],
            "underrun_streams_100ms": listener.get(100.0, {}).get("streams_with_underruns"),
            # Is the engine the limit? (the server reached 0.37x its engine on an H200)
            **engine,
        }
        result["zero_underruns"] = (
            result["underrun_streams"] == 0
            and not s["error_streams"]
            and not s["cut"]
            and s["streams"] >= concurrency
        )
        self.probes[concurrency] = result
        print(f"[bench.gpu] c{concurrency}: {json.dumps(result)}", flush=True)
        return result

    def ttfa(self, limit: float) -> dict[str, Any]:
        """Start the server, then one scenario per ``--ttfa-concurrency``."""
        began = time.perf_counter()
        out = self.start(limit)
        out["scenarios"] = []
        for c in [int(x) for x in self.args.ttfa_concurrency.split(",")]:
            if time.perf_counter() - began > limit - self.args.scenario_s:
                out["scenarios"].append({"concurrency": c, "skipped": "time budget"})
                continue
            out["scenarios"].append(self.probe(c))
        return out

    def search(self, limit: float) -> dict[str, Any]:
        """Largest concurrency with zero underruns: double from the best known, then bisect."""
        if self.server.proc is None or self.server.proc.returncode is not None:
            raise RuntimeError("the server is not running (the ttfa stage failed)")
        began, cap = time.perf_counter(), self.args.max_batch
        good = [c for c, p in self.probes.items() if p["zero_underruns"]]
        bad = [c for c, p in self.probes.items() if not p["zero_underruns"]]
        n = min(cap, 2 * max(good)) if good else max(1, min(bad, default=16) // 2)
        while n not in self.probes and time.perf_counter() - began < limit - 2 * self.args.scenario_s:
            (good if self.probe(n)["zero_underruns"] else bad).append(n)
            lo, hi = max(good, default=0), min([b for b in bad if b > max(good, default=0)], default=None)
            if hi is None:
                n = min(cap, 2 * lo) if lo else 1
            elif hi - lo <= max(1, lo // 8):
                break
            else:
                n = (lo + hi) // 2
        best = max(good, default=0)
        return {
            "largest_zero_underrun_concurrency": best,
            "at_ceiling": best >= cap,
            "listener_ms": self.args.listener_ms,
            "probes": [self.probes[c] for c in sorted(self.probes)],
        }

    def close(self) -> None:
        """Stop the server and the loop."""
        try:
            self.loop.run_until_complete(self.server.stop())
        finally:
            self.loop.close()


def ensure_model(args: argparse.Namespace) -> Path:
    """``--model-dir``, or a dev model (tiny for the smoke, full otherwise) made once in the cache."""
    if args.model_dir is not None:
        return Path(args.model_dir)
    size = "tiny" if args.smoke else "full"
    directory = Path(args.cache_dir) / f"dev-{size}"
    if not (directory / "DEV_MODEL.json").is_file():
        print(f"[bench.gpu] writing a random-weight {size} dev model to {directory}", flush=True)
        subprocess.run(
            [sys.executable, "-m", "server", "make-dev-model", "--size", size, str(directory)],
            cwd=REPO_ROOT,
            check=True,
        )
    return directory


def main(argv: list[str] | None = None) -> int:
    """Run the stages within the budget; exit 1 when a stage failed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.smoke:
        apply_smoke(args)
    if args.test_workers is None:
        args.test_workers = 0 if args.smoke or args.device == "cpu" else 8
    if args.budget_s is None:
        args.budget_s = 300.0 if args.smoke else 540.0
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # children inherit it (see bench/README)
    info = versions(args.device)
    if args.out is None:
        name = "cpu" if args.device == "cpu" else slug(info.get("gpu") or args.device).removeprefix("nvidia-")
        base = Path(tempfile.gettempdir()) if args.smoke else REPO_ROOT / "bench" / "results" / "gpu"
        args.out = base / name
    run = Run(args, argv, args.out)
    run.results["versions"] = info
    print(f"[bench.gpu] {info}; budget {args.budget_s:.0f} s; results → {args.out}.json/.md", flush=True)
    args.model_dir = ensure_model(args)
    wanted = set(args.stages.split(","))
    if "tests" in wanted:
        run.stage("tests", args.tests_cap_s, lambda limit: stage_tests(args, limit))
    if "step" in wanted:
        run.stage("step", 120.0, lambda limit: stage_step(args, limit, run.workdir))
    if "engine" in wanted:
        run.stage("engine", 150.0, lambda limit: stage_engine(args, limit, run.workdir))
    if wanted & {"ttfa", "search"}:
        server = ServerStages(args, run.workdir)
        try:
            run.stage("ttfa", 180.0, server.ttfa)
            if "search" in wanted:
                run.stage("search", 240.0, server.search)
        finally:
            server.close()
            run.results["server_log_tail"] = _tail(run.workdir / "server.log")
    run.write()
    print(render(run.results), flush=True)
    failed = [n for n, s in run.results["stages"].items() if s["status"] != "ok"]
    return 1 if failed or run.results["verdicts"].get("model_tests_pass") is False else 0


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


if __name__ == "__main__":
    raise SystemExit(main())
