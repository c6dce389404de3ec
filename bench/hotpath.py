"""Issue #15 on the CPU: the engine hot path before and after, and ChatTTS's own ``infer()``, in one run.

Usage (full-size random-weight model; the "before" code is a checkout of the commit before the change)::

    python -m server make-dev-model --size full /tmp/dev-full
    git worktree add /tmp/gpu-before ee2787d
    python -m bench.hotpath --model-dir /tmp/dev-full --before /tmp/gpu-before --rounds 2 \\
        --out bench/results/hotpath_cpu

Every round runs three child processes one after the other (``bench.hotpath_child``):
the engine of ``--before``, the engine of this tree, and ChatTTS's ``Chat.infer(stream=True)``
(stock float32, ``skip_refine_text``, ``split_text=False``), each loading the model once.
Rounds interleave the systems, so load from other work on a shared machine falls on all of
them; medians over rounds are reported. Engines run bf16 (the CPU default), 2 threads, EOS
banned so that every job runs to its own length (jobs of 120–259 tokens, staggered so rows
end and new ones join at different steps, as streams do on a server); ChatTTS's rows all run
the mean of those lengths (it cannot give rows different lengths in one batch).

Measured: time to first audio at 1 stream; one steady-state 32-token block at batch 1 and 8
(wall time per token step by category: Llama step, sampling, audio decode, prefill, and the
rest: heads, embeddings, Python and bookkeeping); closed loops at 4 and 8 streams (audio-s
per wall-s and per CPU-s, and where the time went). Writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.machine import describe_machine

REPO = Path(__file__).resolve().parents[1]
CATEGORIES = ("llama", "sampling", "decode", "prefill")


def run_child(system: str, code_root: Path, args: argparse.Namespace, tmp: Path, tag: str) -> dict[str, Any]:
    """One child process; its JSON (or ``{"error": ...}`` when it failed)."""
    out = tmp / f"{tag}.json"
    argv = [
        sys.executable, "-m", "bench.hotpath_child", "--system", system, "--code-root", str(code_root),
        "--model-dir", str(args.model_dir), "--out", str(out), "--threads", str(args.threads),
        "--jobs-per-row", str(args.jobs_per_row), "--concurrency", args.concurrency,
    ]  # fmt: skip
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}
    began = time.perf_counter()
    print(f"[hotpath] {tag}: {shlex.join(argv)}", flush=True)
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        return {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
    data: dict[str, Any] = json.loads(out.read_text())
    data["child_s"] = time.perf_counter() - began
    data["loadavg_after"] = list(os.getloadavg())
    load = data["loadavg_after"][0]
    print(f"[hotpath] {tag}: done in {data['child_s']:.0f} s, load {load:.1f}", flush=True)
    return data


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _shares(entry: dict[str, Any], tokens: float) -> dict[str, float]:
    """Milliseconds per unit (token step, audio-second) by category; ``other``: the rest of the wall time."""
    seconds = entry["seconds"]
    row = {c: 1000 * seconds.get(c, 0.0) / tokens for c in CATEGORIES}
    row["other"] = 1000 * entry["wall_s"] / tokens - sum(row.values())
    row["total"] = 1000 * entry["wall_s"] / tokens
    return row


def summarize(rounds: list[dict[str, dict[str, Any]]], concurrency: list[int]) -> dict[str, Any]:
    """Medians over rounds of every figure the report shows."""
    systems = ("before", "after", "native")
    ok = {s: [r[s] for r in rounds if "error" not in r.get(s, {"error": 1})] for s in systems}
    summary: dict[str, Any] = {"rounds_ok": {s: len(v) for s, v in ok.items()}}
    for system in ("before", "after"):
        runs = ok[system]
        summary[system] = {
            "ttfa_p50_s": _median([_median(r["ttfa_s"]) for r in runs]),
            "profile": {
                b: {
                    c: _median([_shares(r["profile"][b], r["profile"][b]["tokens"])[c] for r in runs])
                    for c in (*CATEGORIES, "other", "total")
                }
                for b in ("1", "8")
            },
        }
    for system in systems:
        closed = {str(n): _closed([r["closed"][str(n)] for r in ok[system]]) for n in concurrency}
        summary.setdefault(system, {})["closed"] = closed
    before, after, native = (summary[s]["closed"] for s in systems)
    summary["targets"] = {
        "throughput_c8_ratio": after["8"]["audio_per_wall"] / before["8"]["audio_per_wall"],
        "ttfa_c1_ratio": summary["after"]["ttfa_p50_s"] / summary["before"]["ttfa_p50_s"],
        **{
            f"cpu_efficiency_c{n}_vs_native": after[str(n)]["audio_per_cpu"] / native[str(n)]["audio_per_cpu"]
            for n in concurrency
        },
    }
    return summary


def _closed(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of one closed-loop scenario over rounds."""
    return {
        "audio_per_wall": _median([r["audio_s"] / r["wall_s"] for r in runs]),
        "audio_per_cpu": _median([r["audio_s"] / r["cpu_s"] for r in runs]),
        "ms_per_audio_s": {
            c: _median([_shares(r, r["audio_s"])[c] for r in runs]) for c in (*CATEGORIES, "other", "total")
        },
    }


def _row(label: str, values: dict[str, float]) -> str:
    cells = " | ".join(f"{values[c]:.1f}" for c in (*CATEGORIES, "other", "total"))
    return f"| {label} | {cells} |"


def _target_row(label: str, values: list[float], ratio: float, target: str, met: bool) -> str:
    cells = " | ".join("—" if v != v else f"{v:.3f}" for v in values)
    return f"| {label} | {cells} | {ratio:.2f}× | {target} | {'yes' if met else '**no**'} |"


def render(result: dict[str, Any]) -> str:
    """The markdown report."""
    s, meta = result["summary"], result["meta"]
    t, m = s["targets"], meta["machine"]
    before, after, native = (s[x]["closed"] for x in ("before", "after", "native"))
    head = "| | Llama step | sampling | audio decode | prefill | other (heads, Python, bookkeeping) | total |"
    rule = "|---|---|---|---|---|---|---|"
    lines = [
        "# Engine hot path on the CPU: before vs after (issue #15), and ChatTTS's own infer()",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {m['cpu_model']}, {m['cpu_cores']} cores, {m['memory_gib']} GiB; "
        f"torch {m['versions']['torch']}; 2 torch threads, `OMP_WAIT_POLICY=PASSIVE`. "
        f"**Shared with other jobs** (load average at start {m['loadavg_at_start'][0]:.1f}, "
        f"after each child: {meta['loadavgs']}); systems interleaved in {meta['rounds']} rounds, "
        f"medians shown. Before = `{meta['before_commit']}`, after = `{meta['after_commit']}`. "
        "Full-size random-weight model, engines bf16, ChatTTS float32 (stock).",
        "",
        "## Targets",
        "",
        "| measure | before | after | ChatTTS infer | ratio | target | met |",
        "|---|---|---|---|---|---|---|",
        _target_row(
            "audio-s per wall-s, 8 streams",
            [x["8"]["audio_per_wall"] for x in (before, after, native)],
            t["throughput_c8_ratio"],
            "≥ 1.15× before",
            t["throughput_c8_ratio"] >= 1.15,
        ),
        _target_row(
            "time to first audio p50, 1 stream (s)",
            [s["before"]["ttfa_p50_s"], s["after"]["ttfa_p50_s"], float("nan")],
            t["ttfa_c1_ratio"],
            "≤ 1.1× before",
            t["ttfa_c1_ratio"] <= 1.1,
        ),
    ]
    for n in ("4", "8"):
        key = f"cpu_efficiency_c{n}_vs_native"
        if key in t:
            values = [x[n]["audio_per_cpu"] for x in (before, after, native)]
            label = f"audio-s per CPU-s, {n} streams"
            lines.append(_target_row(label, values, t[key], "≥ 1× native", t[key] >= 1))
    lines += ["", "## One steady-state block (32 tokens): ms of wall time per token step", "", head, rule]
    for b in ("1", "8"):
        for system in ("before", "after"):
            lines.append(_row(f"{system}, batch {b}", s[system]["profile"][b]))
    for n in ("4", "8"):
        lines += ["", f"## Closed loop, {n} streams: ms of wall time per second of audio", "", head, rule]
        for system in ("before", "after", "native"):
            lines.append(_row(system, s[system]["closed"][n]["ms_per_audio_s"]))
    lines += ["", "## Notes", "", *meta.get("notes", [])]
    return "\n".join(lines) + "\n"


def main() -> int:
    """Run the rounds, write JSON and markdown (partial results too, if a child failed)."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--model-dir", type=Path, required=True, help="full-size dev model (make-dev-model)")
    parser.add_argument("--before", type=Path, required=True, help="checkout of the code before the change")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--jobs-per-row", type=int, default=2)
    parser.add_argument("--concurrency", default="4,8")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/hotpath_cpu")
    args = parser.parse_args()
    concurrency = [int(x) for x in args.concurrency.split(",")]

    def commit(root: Path) -> str:
        argv = ["git", "-C", str(root), "rev-parse", "--short", "HEAD"]
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout.strip()

    meta: dict[str, Any] = {
        "command": "python -m bench.hotpath " + shlex.join(sys.argv[1:]),
        "machine": describe_machine(),
        "rounds": args.rounds,
        "before_commit": commit(args.before),
        "after_commit": commit(REPO),
        "loadavgs": [],
    }
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="hotpath-") as tmp:
        for r in range(args.rounds):
            results = {}
            plan = (("before", "engine", args.before), ("after", "engine", REPO), ("native", "native", REPO))
            for system, kind, root in plan:
                results[system] = run_child(kind, root, args, Path(tmp), f"{system}-{r}")
                meta["loadavgs"].append(round(results[system].get("loadavg_after", [float("nan")])[0], 1))
            rounds.append(results)
            result = {"meta": meta, "rounds": rounds}
            try:
                result["summary"] = summarize(rounds, concurrency)
            except (KeyError, ZeroDivisionError, TypeError) as exc:  # a system failed every round so far
                result["summary_error"] = repr(exc)
            args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
            if "summary" in result:
                args.out.with_suffix(".md").write_text(render(result))
    print(args.out.with_suffix(".md").read_text() if args.out.with_suffix(".md").exists() else "no summary")
    return 0 if all("error" not in v for r in rounds for v in r.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
