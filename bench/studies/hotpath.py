"""Issue #15 on the CPU: the engine hot path before and after, and ChatTTS's own ``infer()``, in one run.

Usage (full-size random-weight model; the "before" code is a checkout of the commit before the change)::

    python -m server make-dev-model --size full /tmp/dev-full
    git worktree add /tmp/gpu-before ee2787d
    python -m bench.studies.hotpath --model-dir /tmp/dev-full --before /tmp/gpu-before \\
        --out bench/results/studies/hotpath-<hw>

Three long-lived child processes (``bench.baselines.system``) each load one system once: the
engine of ``--before``, the engine of this tree, and ChatTTS's ``Chat.infer(stream=True)``
(stock float32, ``skip_refine_text``, ``split_text=False``). Each scenario then runs on the
two engines back to back, their order flipped every time, while the idle children wait.
The closed loops run in slices: every engine keeps its loop running between its slices, so
the two engines alternate every ``--slice-s`` seconds in steady state, and the after/before
ratio of every pair of adjacent slices is taken (load from other work on a shared machine
changes more slowly than that); the median of those ratios is the reported speed-up.
Engines run bf16 (the CPU default), 2 threads, EOS banned so that every job runs to its own
length (jobs of 120–259 tokens, staggered so rows end and new ones join at different steps,
as streams do on a server); ChatTTS's rows all run the mean of those lengths (it cannot give
rows different lengths in one batch), one static batch per run.

Measured: time to first audio at 1 stream (median); one steady-state 32-token block at batch
1 and 8, the fastest of 6, with its wall time per token step split into Llama step,
sampling, audio decode, prefill and the rest (heads, embeddings, Python, bookkeeping);
closed loops at 4 and 8 streams: audio-s per wall-s and per CPU-s, and where the time went.
Writes ``OUT.json`` and ``OUT.md``.
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
from pathlib import Path
from typing import Any

from bench.harness.machine import describe_machine, result_stem

REPO = Path(__file__).resolve().parents[2]
CATEGORIES = ("llama", "sampling", "decode", "prefill")


class Child:
    """A long-lived ``bench.baselines.system``: loads its system once, then answers commands."""

    def __init__(self, name: str, system: str, code_root: Path, args: argparse.Namespace, tmp: Path) -> None:
        argv = [
            sys.executable, "-m", "bench.baselines.system", "--system", system, "--code-root", str(code_root),
            "--model-dir", str(args.model_dir), "--threads", str(args.threads),
        ]  # fmt: skip
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}
        self.name, self.log = name, tmp / f"{name}.log"
        print(f"[hotpath] starting {name}: {shlex.join(argv)}", flush=True)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                argv, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )
        self.ready = self._read()["ready"]
        print(f"[hotpath] {name} ready: {self.ready}", flush=True)

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.name} exited ({self.proc.wait()}): {tail}")
        data: dict[str, Any] = json.loads(line)
        return data

    def ask(self, command: dict[str, Any]) -> dict[str, Any]:
        """Run one command; its result, with the load average after it."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        result: dict[str, Any] = reply["result"]
        result["loadavg"] = reply["loadavg"]
        print(f"[hotpath] {self.name} {command}: {_brief(result)}", flush=True)
        return result

    def close(self) -> None:
        """Ask the child to quit (kill it if it does not)."""
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"run": "quit"}) + "\n")
                self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def _brief(result: dict[str, Any]) -> str:
    if "audio_s" in result:
        audio = result["audio_s"]
        return f"{audio / result['wall_s']:.3f} audio-s/s, {audio / result['cpu_s']:.3f} per CPU-s"
    if "ttfa_s" in result:
        return f"ttfa {result['ttfa_s']:.3f} s"
    return f"{1000 * result['wall_s'] / max(1, result['tokens']):.1f} ms per token step"


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _shares(entry: dict[str, Any], unit: float) -> dict[str, float]:
    """Milliseconds per unit (token step, audio-second) by category; ``other``: the rest of the wall time."""
    seconds = entry["seconds"]
    row = {c: 1000 * seconds.get(c, 0.0) / unit for c in CATEGORIES}
    row["other"] = 1000 * entry["wall_s"] / unit - sum(row.values())
    row["total"] = 1000 * entry["wall_s"] / unit
    return row


def measure(children: dict[str, Child], args: argparse.Namespace, raw: dict[str, Any]) -> None:
    """Every scenario on both engines back to back, the order flipped each time; ChatTTS after them."""
    orders = (["before", "after"], ["after", "before"])
    for k in range(args.ttfa):
        for name in orders[k % 2]:
            raw[name]["ttfa"].append(children[name].ask({"run": "ttfa", "k": k}))
    for i in range(2):
        for batch in (1, 8):
            for name in orders[i % 2]:
                raw[name]["profile"][str(batch)].append(
                    children[name].ask({"run": "profile", "batch": batch})
                )
    for n in args.concurrency:
        for name in orders[0]:  # ramp up (every row's first blocks, prefills): not counted
            children[name].ask({"run": "closed", "n": n, "seconds": args.slice_s})
        for i in range(args.slices):
            for name in orders[i % 2]:
                command = {"run": "closed", "n": n, "seconds": args.slice_s, "continue": True}
                raw[name]["closed"][str(n)].append(children[name].ask(command))
        for _ in range(args.native_runs if "native" in children else 0):
            raw["native"]["closed"][str(n)].append(children["native"].ask({"run": "closed", "n": n}))


def summarize(raw: dict[str, Any], concurrency: list[int]) -> dict[str, Any]:
    """Medians, sums over slices, and after/before ratios of adjacent slices (load hits both alike)."""
    summary: dict[str, Any] = {}
    for name in ("before", "after"):
        summary[name] = {
            "ttfa_p50_s": _median([x["ttfa_s"] for x in raw[name]["ttfa"]]),
            "profile": {b: _fastest(runs) for b, runs in raw[name]["profile"].items() if runs},
        }
    for name in ("before", "after", "native"):
        summary.setdefault(name, {})["closed"] = {
            str(n): _closed(raw[name]["closed"][str(n)]) for n in concurrency if raw[name]["closed"][str(n)]
        }
    targets: dict[str, Any] = {
        "ttfa_c1_ratio": summary["after"]["ttfa_p50_s"] / summary["before"]["ttfa_p50_s"]
    }
    for n in concurrency:
        pairs = zip(raw["before"]["closed"][str(n)], raw["after"]["closed"][str(n)], strict=False)
        ratios = [(a["audio_s"] / a["wall_s"]) / (b["audio_s"] / b["wall_s"]) for b, a in pairs]
        targets[f"throughput_c{n}_ratio"] = _median(ratios)
        targets[f"throughput_c{n}_slice_ratios"] = ratios
        if str(n) in summary["native"]["closed"]:
            native = summary["native"]["closed"][str(n)]["audio_per_cpu"]
            targets[f"cpu_efficiency_c{n}_vs_native"] = (
                summary["after"]["closed"][str(n)]["audio_per_cpu"] / native
            )
    summary["targets"] = targets
    return summary


def _fastest(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The fastest profiled block's split (interference only ever adds time)."""
    best = min(runs, key=lambda x: x["wall_s"] / x["tokens"])
    return _shares(best, best["tokens"])


def _closed(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One closed-loop scenario over its slices: totals (audio over time) and the time split."""
    total = {
        "audio_s": sum(r["audio_s"] for r in runs),
        "wall_s": sum(r["wall_s"] for r in runs),
        "cpu_s": sum(r["cpu_s"] for r in runs),
        "seconds": {c: sum(r["seconds"].get(c, 0.0) for r in runs) for c in CATEGORIES},
    }
    return {
        "audio_per_wall": total["audio_s"] / total["wall_s"],
        "audio_per_cpu": total["audio_s"] / total["cpu_s"],
        "ms_per_audio_s": _shares(total, total["audio_s"]),
        "slices": len(runs),
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
        f"**Shared with other jobs** (1-minute load average at start {m['loadavg_at_start'][0]:.1f}; "
        f"after every run in `raw[*].loadavg` of the JSON, {_load_range(result['raw'])}); "
        f"each scenario on both engines back to back, closed loops in {meta['slices']} alternating "
        f"slices of {meta['slice_s']:g} s each. "
        f"Before = `{meta['before_commit']}`, after = `{meta['after_commit']}`. "
        "Full-size random-weight model, engines bf16, ChatTTS float32 (stock).",
        "",
        "## Targets",
        "",
        "| measure | before | after | ChatTTS infer | ratio | target | met |",
        "|---|---|---|---|---|---|---|",
        _target_row(
            "audio-s per wall-s, 8 streams (ratio: median of adjacent slices)",
            [x["8"]["audio_per_wall"] if "8" in x else float("nan") for x in (before, after, native)],
            t.get("throughput_c8_ratio", float("nan")),
            "≥ 1.15× before",
            t.get("throughput_c8_ratio", 0.0) >= 1.15,
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
            if n in s[system]["closed"]:  # ChatTTS is absent with --no-native, a level without --concurrency
                lines.append(_row(system, s[system]["closed"][n]["ms_per_audio_s"]))
    lines += ["", "## Slices: audio-s per wall-s of adjacent runs, load average after each", ""]
    lines += ["| slice | streams | before | after | ratio | load |", "|---|---|---|---|---|---|"]
    raw = result["raw"]
    for n in sorted(raw["after"]["closed"], key=int):
        for i, (b, a) in enumerate(zip(raw["before"]["closed"][n], raw["after"]["closed"][n], strict=False)):
            bw, aw = b["audio_s"] / b["wall_s"], a["audio_s"] / a["wall_s"]
            load = f"{b['loadavg']:.1f} / {a['loadavg']:.1f}"
            lines.append(f"| {i} | {n} | {bw:.3f} | {aw:.3f} | {aw / bw:.2f}× | {load} |")
    lines += ["", "## Notes", "", *meta.get("notes", [])]
    return "\n".join(lines) + "\n"


def _load_range(raw: dict[str, Any]) -> str:
    loads = [x["loadavg"] for runs in raw["after"]["closed"].values() for x in runs]
    loads += [x["loadavg"] for runs in raw["before"]["closed"].values() for x in runs]
    return f"{min(loads):.1f}–{max(loads):.1f} during the closed loops" if loads else "none recorded"


def main() -> int:
    """Start the three children, run every scenario, write JSON and markdown."""
    raw_help = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw_help)
    parser.add_argument("--model-dir", type=Path, required=True, help="full-size dev model (make-dev-model)")
    parser.add_argument("--before", type=Path, required=True, help="checkout of the code before the change")
    parser.add_argument("--slices", type=int, default=8, help="closed-loop slices per engine and level")
    parser.add_argument("--slice-s", type=float, default=12.0, help="length of one closed-loop slice")
    parser.add_argument("--native-runs", type=int, default=1, help="ChatTTS batches per level")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ttfa", type=int, default=8, help="time-to-first-audio samples per engine")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8])
    parser.add_argument("--no-native", action="store_true", help="skip ChatTTS's infer()")
    parser.add_argument("--out", type=Path, default=result_stem("studies", "hotpath"))
    args = parser.parse_args()

    def commit(root: Path) -> str:
        argv = ["git", "-C", str(root), "rev-parse", "--short", "HEAD"]
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout.strip()

    meta: dict[str, Any] = {
        "command": "python -m bench.studies.hotpath " + shlex.join(sys.argv[1:]),
        "machine": describe_machine(),
        "slices": args.slices,
        "slice_s": args.slice_s,
        "before_commit": commit(args.before),
        "after_commit": commit(REPO),
    }
    empty = {"ttfa": [], "profile": {"1": [], "8": []}, "closed": {str(n): [] for n in args.concurrency}}
    raw: dict[str, Any] = {name: json.loads(json.dumps(empty)) for name in ("before", "after", "native")}
    children: dict[str, Child] = {}
    with tempfile.TemporaryDirectory(prefix="hotpath-") as tmp:
        try:
            plan = [("before", "engine", args.before), ("after", "engine", REPO)]
            plan += [] if args.no_native else [("native", "native", REPO)]
            for name, system, root in plan:
                children[name] = Child(name, system, root, args, Path(tmp))
            meta["ready"] = {name: child.ready for name, child in children.items()}
            measure(children, args, raw)
            result = {"meta": meta, "raw": raw, "summary": summarize(raw, args.concurrency)}
            args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
            args.out.with_suffix(".md").write_text(render(result))
        finally:
            for child in children.values():
                child.close()
    print(args.out.with_suffix(".md").read_text() if args.out.with_suffix(".md").exists() else "no results")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
