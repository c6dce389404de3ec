"""How torch's idle OpenMP threads should wait (issue #23): the token step per wait setting, alone and shared.

``python -m bench.studies.omp_spin --model-dir DIR --out bench/results/studies/omp-spin-<hw>``

libgomp (the OpenMP of PyTorch's pip wheels) reads its wait settings once, when torch
loads, so every setting runs in a child process of its own: ``OMP_WAIT_POLICY=PASSIVE``
(an idle thread sleeps in the kernel at once), ``GOMP_SPINCOUNT=N`` (it busy-waits N
iterations first; libgomp's own default is 300000) and ``OMP_WAIT_POLICY=ACTIVE``. Each
child loads the engine (bf16, ``--threads`` torch threads) and times its token step at
batch 1 and 8 (the fastest of three median-of-three runs, :func:`bench.cpu.rig.median_ms`).
Every setting is measured twice: on an otherwise idle machine, and with ``--hogs``
busy-looping processes beside it (a CPU shared with other work), where spinning threads
fight the other process for the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.harness.machine import describe_machine, result_stem
from bench.harness.servers import REPO_ROOT
from server.config import OPENMP_VARIABLES

#: The settings measured: name → the environment a child gets.
SETTINGS: dict[str, dict[str, str]] = {
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin 1000": {"GOMP_SPINCOUNT": "1000"},
    "spin 3000": {"GOMP_SPINCOUNT": "3000"},
    "spin 10000": {"GOMP_SPINCOUNT": "10000"},
    "spin 30000": {"GOMP_SPINCOUNT": "30000"},
    "spin 100000": {"GOMP_SPINCOUNT": "100000"},
    "libgomp default (300000)": {},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
}
HOG = "while True: pass"


def child(model_dir: Path, threads: int) -> dict[str, Any]:
    """In the child: the engine's bf16 token step at (1, 256) and (8, 512), ms wall and CPU."""
    import torch

    torch.set_num_threads(threads)
    from bench.cpu.rig import bf16_cpu_engine, median_ms

    engine = bf16_cpu_engine(model_dir, max_batch=8)
    step = engine._batch.token_step
    out: dict[str, Any] = {"env_seen": {k: os.environ[k] for k in OPENMP_VARIABLES if k in os.environ}}
    with torch.inference_mode():
        for batch, length in ((1, 256), (8, 512)):
            wall, cpu = min(median_ms(lambda b=batch, n=length: step(b, n), 8) for _ in range(3))
            out[f"b{batch}"] = {"ms": wall, "cpu_ms": cpu, "length": length}
    return out


def measure(name: str, hogs: int, args: argparse.Namespace) -> dict[str, Any]:
    """One setting in a fresh child, ``hogs`` busy loops running beside it."""
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_VARIABLES}
    env.update(SETTINGS[name])
    argv = [sys.executable, "-m", "bench.studies.omp_spin", "--child", "--model-dir", str(args.model_dir)]
    argv += ["--threads", str(args.threads)]
    busy = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)]
    try:
        done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    if done.returncode:
        raise RuntimeError(f"{name}: the child failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, "hogs": hogs, "loadavg": os.getloadavg()[0]}


def render(result: dict[str, Any]) -> str:
    """The Markdown report."""
    m = result["machine"]
    lines = [
        "# How idle OpenMP threads wait: the token step per setting (issue #23)",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {m.get('cpu_model')}, {m.get('cpu_cores')} cores, torch "
        f"{m.get('versions', {}).get('torch')}; {result['threads']} torch threads; the engine's bf16 "
        "token step (prepacked projections), ms per step, the fastest of three median-of-three runs "
        f"(CPU ms of this process in brackets). 'shared': {result['hogs']} busy-looping process(es) "
        "beside it.",
        "",
        "| setting | alone, batch 1 | alone, batch 8 | shared, batch 1 | shared, batch 8 |",
        "|---|---|---|---|---|",
    ]
    for name, row in result["rows"].items():
        cells = [
            f"{row[where][b]['ms']:.1f} ({row[where][b]['cpu_ms']:.1f})"
            for where in ("alone", "shared")
            for b in ("b1", "b8")
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    """Measure every setting alone and shared; write ``OUT.json`` and ``OUT.md``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True, help="full-size dev model (make-dev-model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hogs", type=int, default=1, help="busy-looping processes of the 'shared' case")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names of SETTINGS")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=result_stem("studies", "omp-spin"))
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.model_dir, args.threads)), flush=True)
        return 0
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        p.error(f"--settings: unknown {unknown}; known: {', '.join(SETTINGS)}")
    result: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "bench.studies.omp_spin", *sys.argv[1:]]),
        "machine": describe_machine(),
        "threads": args.threads,
        "hogs": args.hogs,
        "rows": {},
    }
    for name in names:
        row = {
            "env": SETTINGS[name],
            "alone": measure(name, 0, args),
            "shared": measure(name, args.hogs, args),
        }
        result["rows"][name] = row
        print(
            f"[omp_spin] {name}: {row['alone']['b1']['ms']:.1f} / {row['shared']['b1']['ms']:.1f} ms",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(render(result))
    print(render(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
