"""The server's memory on the CPU (issue #23): RSS after warm-up and while streams play, before and after.

Each system is a ``serve`` subprocess with the default flags (only ``--model-dir``), one at a
time: the tree under test, and optionally an older tree (``--before DIR``, e.g. a ``git
archive`` of the commit before the change) run by the same Python. For each: RSS once
``/ready`` answers (warm-up done), then ``--streams`` streams in a closed loop for
``--duration`` s while RSS, ``chattts_kv_resident_bytes`` and ``chattts_active_streams`` are
sampled. RSS does not depend on the machine's load; the load average is recorded anyway.

``--rows`` adds the engine in-process (this tree): that many rows with EOS banned, grown
together to ``--row-tokens`` tokens each (the longest a segment may run by default is 2048),
RSS and the reported KV after every block: what the memory is when every stream runs long.

    python -m bench.cpu.memory --model-dir DIR --before /tmp/before --out bench/results/cpu/memory-<hw>
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from bench.harness.client import StreamOptions, run_stream
from bench.harness.engine_bench import command
from bench.harness.load import LoadSpec, run_load
from bench.harness.machine import describe_machine
from bench.harness.servers import REPO_ROOT, ServerProcess
from bench.harness.textset import DEFAULT_TEXTS, load_texts, seed_base

GIB = 2**30


def _metrics(port: int) -> dict[str, float]:
    """The server's unlabelled gauges and counters from ``/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            values[name] = float(value)
    return values


async def _sample(server: ServerProcess, samples: list[dict[str, Any]], stop: asyncio.Event) -> None:
    """RSS and the memory gauges every 0.25 s until ``stop``."""
    assert server.proc is not None
    process = psutil.Process(server.proc.pid)
    began = time.perf_counter()
    while not stop.is_set():
        gauges = await asyncio.to_thread(_metrics, server.port)
        samples.append(
            {
                "t": round(time.perf_counter() - began, 2),
                "rss": process.memory_info().rss,
                "kv_resident": gauges.get("chattts_kv_resident_bytes"),
                "active": gauges.get("chattts_active_streams"),
            }
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)


async def measure_server(name: str, cwd: Path, args: argparse.Namespace, log: Path) -> dict[str, Any]:
    """One ``serve`` process: start-up, RSS at rest after warm-up, RSS while the streams play."""
    server = ServerProcess(["--model-dir", str(args.model_dir)], cwd=cwd, log_path=log)
    print(f"cpu_memory: starting {name} ({cwd})", file=sys.stderr)
    await server.start(timeout_s=900)
    try:
        assert server.proc is not None
        process = psutil.Process(server.proc.pid)
        gauges = await asyncio.to_thread(_metrics, server.port)
        at_rest = []
        for _ in range(8):  # 2 s at rest: warm-up requests done, nothing running
            at_rest.append(process.memory_info().rss)
            await asyncio.sleep(0.25)
        texts = load_texts(args.texts)
        spec = LoadSpec(
            "closed",
            concurrency=args.streams,
            duration_s=args.duration,
            grace_s=args.grace_s,
            seed_base=seed_base(1, f"c{args.streams}"),
        )
        options = StreamOptions(system=name, max_audio_s=args.max_audio_s)
        samples: list[dict[str, Any]] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample(server, samples, stop))
        try:
            run = await run_load(texts, spec, lambda job, cut: run_stream(server.url, job, options, cut))
        finally:
            stop.set()
            await sampler
        playing = [s for s in samples if (s["active"] or 0) >= args.streams]
        audio_s = sum(r.samples / r.sample_rate for r in run.records)
        return {
            "name": name,
            "tree": str(cwd),
            "command": server.describe()["command"],
            "ready_s": server.ready_s,
            "kv_cache_bytes": gauges.get("chattts_kv_cache_bytes"),
            "rss_at_rest": max(at_rest),
            "rss_peak": max(s["rss"] for s in samples),
            "rss_playing_max": max((s["rss"] for s in playing), default=None),
            "kv_resident_peak": max((s["kv_resident"] or 0 for s in samples), default=None),
            "samples_playing": len(playing),
            "streams": len(run.records),
            "errors": sum(1 for r in run.records if r.errors),
            "audio_s": round(audio_s, 1),
            "wall_s": round(run.t_end - run.t_start, 1),
            "loadavg": os.getloadavg(),
            "samples": samples,
        }
    finally:
        await server.stop()


def engine_rows(model_dir: Path, rows: int, tokens: int) -> dict[str, Any]:
    """In this process: ``rows`` rows with EOS banned, grown to ``tokens`` each; RSS per block."""
    from server.engine.chattts.engine import ChatTTSEngine
    from server.engine.chattts.options import EngineOptions
    from server.engine_api import SequenceRequest, SynthesisParams

    engine = ChatTTSEngine.load(
        model_dir=model_dir, device="cpu", options=EngineOptions(min_tokens=tokens + 1)
    )  # the server's defaults otherwise (dtype auto, 16 slots)
    engine.warmup()
    process = psutil.Process()
    warm = process.memory_info().rss
    for i in range(rows):
        text = f"Row {i} reads a sentence of ordinary length, as a stream would."
        engine.add(SequenceRequest(seq_id=i, text=text, params=SynthesisParams(seed=i), max_tokens=tokens))
    live, blocks = list(range(rows)), []
    while live:
        results = engine.step(live)
        positions = sum(row.length for row in engine._seqs.values())
        rss, kv = process.memory_info().rss, engine.kv_resident_bytes()
        blocks.append({"positions": positions, "kv_resident": kv, "rss": rss})
        live = [r.seq_id for r in results if not r.finished]
    return {
        "rows": rows,
        "tokens": tokens,
        "kv_cache_bytes": engine.kv_cache_bytes,
        "rss_warm": warm,
        "rss_after": process.memory_info().rss,
        "kv_after": engine.kv_resident_bytes(),
        "blocks": blocks,
        "loadavg": os.getloadavg(),
    }


def _gib(value: float | None) -> str:
    return "—" if value is None else f"{value / GIB:.2f}"


def render(report: dict[str, Any]) -> str:
    """The result as markdown."""
    m = report["machine"]
    lines = [
        "# The server's memory on the CPU (issue #23)",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {m.get('cpu_model')} ({m.get('cpu_cores')} cores, {m.get('memory_gib')} GiB), torch "
        f"{m['versions'].get('torch')}, load average at start {m.get('loadavg_at_start')}. Full-size "
        "random-weight dev model; every server with the default flags (dtype auto = bfloat16 here, "
        "16 KV slots, --segment-max-tokens 2048).",
        "",
        f"| system | ready after (s) | KV reserved (GiB) | RSS after warm-up (GiB) | RSS peak, "
        f"{report['streams']} streams playing (GiB) | KV resident peak (GiB) | streams (errors) | audio (s) "
        "| load average after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in report["servers"]:
        lines.append(
            f"| {s['name']} | {s['ready_s']:.0f} | {_gib(s['kv_cache_bytes'])} | {_gib(s['rss_at_rest'])} | "
            f"{_gib(s['rss_playing_max'] or s['rss_peak'])} | {_gib(s['kv_resident_peak'] or None)} | "
            f"{s['streams']} ({s['errors']}) | {s['audio_s']} | {s['loadavg'][0]:.1f} |"
        )
    rows = report.get("engine_rows")
    if rows:
        lines += [
            "",
            f"The engine in-process (this tree), {rows['rows']} rows with EOS banned grown to "
            f"{rows['tokens']} tokens each; RSS after warm-up {_gib(rows['rss_warm'])} GiB:",
            "",
            "| positions held (all rows) | KV resident reported (GiB) | RSS (GiB) "
            "| RSS − RSS after warm-up (GiB) |",
            "|---|---|---|---|",
        ]
        blocks = [b for b in rows["blocks"] if b["positions"]]  # while rows live
        picked = blocks[:: max(1, len(blocks) // 8)] + blocks[-1:]
        for b in sorted({id(b): b for b in picked}.values(), key=lambda b: int(b["positions"])):
            grown = b["rss"] - rows["rss_warm"]
            kv, rss = _gib(b["kv_resident"]), _gib(b["rss"])
            lines.append(f"| {b['positions']} | {kv} | {rss} | {_gib(grown)} |")
        lines.append(
            f"| all rows ended | {_gib(rows['kv_after'])} | {_gib(rows['rss_after'])} | "
            f"{_gib(rows['rss_after'] - rows['rss_warm'])} |"
        )
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    """Every system in turn; the report."""
    report: dict[str, Any] = {"command": command("bench.cpu.memory"), "machine": describe_machine()}
    report["streams"], report["servers"] = args.streams, []
    logs = Path(tempfile.mkdtemp(prefix=f"{args.out.name}-logs-"))  # the servers' logs, kept out of results
    print(f"logs in {logs}", file=sys.stderr)
    trees = [("after (this tree)", REPO_ROOT)]
    if args.before:
        trees.insert(0, ("before", args.before.resolve()))
    for name, tree in trees:
        report["servers"].append(await measure_server(name, tree, args, logs / f"{tree.name}.log"))
        rest = _gib(report["servers"][-1]["rss_at_rest"])
        print(f"cpu_memory: {name}: {rest} GiB at rest after warm-up", file=sys.stderr)
    if args.rows:
        child = [sys.executable, "-m", "bench.cpu.memory", "--engine-rows-child", *sys.argv[1:]]
        out = await asyncio.to_thread(subprocess.run, child, cwd=REPO_ROOT, capture_output=True, check=True)
        report["engine_rows"] = json.loads(out.stdout)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model-dir", type=Path, required=True, help="full-size model (make-dev-model --size full)")
    add("--before", type=Path, help="an older tree to measure first, run by the same Python")
    add("--streams", type=int, default=8, help="streams in flight while RSS is sampled")
    add("--duration", type=float, default=40.0, help="seconds of new streams")
    add("--grace-s", type=float, default=30.0, help="streams still running after this are cut")
    add("--max-audio-s", type=float, default=0.0, help="cut each stream after this much audio")
    add("--texts", type=Path, default=DEFAULT_TEXTS)
    add("--rows", type=int, default=0, help="also the engine in-process with this many rows")
    add("--row-tokens", type=int, default=2048, help="tokens each of those rows grows to")
    add("--out", type=Path, required=True, help="path without suffix: writes .json and .md")
    parser.add_argument("--engine-rows-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_rows_child:
        print(json.dumps(engine_rows(args.model_dir, args.rows, args.row_tokens)))
        return
    report = asyncio.run(main_async(args))
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(render(report))
    print(render(report))


if __name__ == "__main__":
    main()
