"""``python -m bench.gpu.engine``: where the engine's time goes on a GPU, in-process, no server.

``python -m bench.gpu.engine --model-dir DIR --device cuda --out bench/results/gpu/engine-<gpu>``

The server stage of :mod:`bench.gpu` tells how many streams play; this tells why not more.
The engine of this tree (bf16, CUDA graphs as served, EOS banned so every job runs to its
own length) is loaded once, in this process, and then:

1. **closed loops** at ``--levels`` rows for ``--seconds`` each (after ``--settle-s``
   untimed: every row's prefill at the start would weigh on a few seconds), every ended row
   replaced by the next job (the loop of ``bench.baselines.system``): audio-s per wall-s of the
   engine alone, the ceiling the server's own figure is compared with, and its token steps
   per engine step (the server's ``/metrics`` figure "tokens per block");
2. **one steady-state block** at batch 1 and at ``--max-batch``, its wall time per token step
   split into Llama step, sampling, audio decode, prefill and the rest, with the device
   synchronised after each part (so each part's time is its own; this costs some speed);
3. **torch.profiler** over blocks at ``--max-batch``: the operators that take the host's
   time and the device's time, the top rows of each.

Writes ``OUT.json`` and ``OUT.md``. Runs on the CPU with the tiny model too (its smoke test).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench.baselines.system import SAMPLE_RATE, EngineSystem


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m bench.gpu.engine`` arguments."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu.engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-batch", type=int, default=64, help="KV slots; the profiled batch")
    p.add_argument("--levels", default="1,16,64", help="closed-loop row counts")
    p.add_argument("--seconds", type=float, default=8.0, help="length of each closed loop")
    p.add_argument("--profile-blocks", type=int, default=2, help="blocks under torch.profiler")
    p.add_argument("--low", type=int, default=120, help="shortest job, tokens")
    p.add_argument("--span", type=int, default=140, help="job lengths spread over this many tokens")
    p.add_argument(
        "--settle-s",
        type=float,
        default=2.0,
        help="untimed seconds of each closed loop first (its start: every row's prefill at once)",
    )
    p.add_argument("--block-schedule", help="the engine's block schedule (default: the engine's own)")
    p.add_argument("--out", type=Path, required=True, help="output prefix")
    return p


def split_per_step(block: dict[str, Any]) -> dict[str, float]:
    """Milliseconds per token step of each part of one block; ``rest`` is what no part explains."""
    steps = max(1, block["tokens"])
    parts = {k: 1000 * v / steps for k, v in block["seconds"].items()}
    parts["rest"] = 1000 * block["wall_s"] / steps - sum(parts.values())
    parts["total"] = 1000 * block["wall_s"] / steps
    return {k: round(v, 3) for k, v in parts.items()}


def profile_table(system: EngineSystem, batch: int, blocks: int, device: Any) -> dict[str, str]:
    """torch.profiler over ``blocks`` steady-state blocks at ``batch`` rows: top operators."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    ids = system.steady_rows(batch)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(blocks):
            system.engine.step(ids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for sid in ids:
        system.engine.drop(sid)
    averages = prof.key_averages()
    tables = {"host": averages.table(sort_by="self_cpu_time_total", row_limit=25)}
    if device.type == "cuda":
        tables["device"] = averages.table(sort_by="self_cuda_time_total", row_limit=25)
    return tables


def render(results: dict[str, Any]) -> str:
    """The markdown report."""
    lines = [
        "# python -m bench.gpu.engine",
        "",
        f"Command: `{results['command']}`; device {results['device']}; "
        f"load and warm-up {results['ready']['load_and_warmup_s']:.1f} s; "
        f"block schedule {results.get('block_schedule')}.",
        "",
        "## Closed loops, engine in-process",
        "",
        "| rows | audio-s per wall-s | audio-s per CPU-s | jobs started | tokens per block |",
        "|---|---|---|---|---|",
    ]
    for n, c in results["closed"].items():
        lines.append(
            f"| {n} | {c['audio_s_per_wall_s']:.2f} | {c['audio_s_per_cpu_s']:.2f} | {c['jobs_started']} "
            f"| {c['tokens_per_block']:.2f} |"
        )
    lines += ["", "## One steady-state block, ms per token step (device synchronised per part)", ""]
    for batch, parts in results["blocks"].items():
        tokens = results.get("block_tokens", {}).get(batch)
        lines.append(
            f"- batch {batch} ({tokens} token steps): " + ", ".join(f"{k} {v}" for k, v in parts.items())
        )
    for name, table in results.get("profile", {}).items():
        title = f"## torch.profiler, {name} time, batch {results['max_batch']}"
        lines += ["", title, "", "```", table, "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Load the engine, run the closed loops, the split and the profile; write the report."""
    import sys

    import torch

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    system = EngineSystem(args)
    results: dict[str, Any] = {
        "command": "python -m bench.gpu.engine " + " ".join(argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "max_batch": args.max_batch,
        "ready": system.ready,
        "block_schedule": ",".join(str(n) for n in getattr(system.engine, "block_schedule", ())),
        "closed": {},
        "blocks": {},
    }
    out_json, out_md = args.out.with_name(args.out.name + ".json"), args.out.with_name(args.out.name + ".md")
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        out_json.write_text(json.dumps(results, indent=1) + "\n")
        out_md.write_text(render(results))

    for n in [int(x) for x in args.levels.split(",")]:
        rows = min(n, args.max_batch)
        if args.settle_s > 0:
            system.closed({"n": rows, "seconds": args.settle_s})
        c = system.closed({"n": rows, "seconds": args.seconds, "continue": args.settle_s > 0})
        c["tokens_per_block"] = c["token_steps"] / max(c["blocks"], 1)
        c["audio_s_per_wall_s"] = c["audio_s"] / c["wall_s"]
        c["audio_s_per_cpu_s"] = c["audio_s"] / max(c["cpu_s"], 1e-9)
        results["closed"][str(n)] = c
        print(f"[gpu_engine] closed {n}: {c['audio_s_per_wall_s']:.2f} audio-s per wall-s", flush=True)
        write()
    system.end_loop()  # the closed loop's rows hold slots the blocks need
    if device.type == "cuda":
        system.profile.sync = lambda: torch.cuda.synchronize(device)
    for batch in sorted({1, args.max_batch}):
        block = system.profile_block({"batch": batch})
        results["blocks"][str(batch)] = split_per_step(block)
        results.setdefault("block_tokens", {})[str(batch)] = block["tokens"]
        print(f"[gpu_engine] block {batch}: {results['blocks'][str(batch)]}", flush=True)
        write()
    system.profile.sync = lambda: None
    began = time.perf_counter()
    results["profile"] = profile_table(system, args.max_batch, args.profile_blocks, device)
    results["profile_s"] = round(time.perf_counter() - began, 1)
    results["sample_rate"] = SAMPLE_RATE
    write()
    print(render(results), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
