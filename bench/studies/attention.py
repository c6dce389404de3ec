"""The compiled CPU step's single-query attention against reading the same bytes (issue #23).

``python -m bench.studies.attention --shapes 1x128,4x256,8x320 --threads 2 \\
    --out bench/results/studies/attention-<hw>``

At eight streams the token step reads two things from memory: the GPT's weights and every
row's keys and values up to the attention length (the longest row's bucket). This bench
measures the second alone, in the layout the engine keeps them in (:class:`SlotKV`, slots of
``kv_dtype`` under ``--compile-step on``: bf16), for every ``BATCHxLENGTH`` shape:

* ``attention``: the step's own :func:`~server.engine.chattts.step.llama.math_attention` over
  ``--layers`` layers, compiled by inductor as the step is (``torch.compile``, dynamic shapes);
* ``decode_attention``: the C++ operator the compiled step calls
  (:mod:`server.engine.chattts.step.decode_attention`), which reads each row only up to
  its own last unmasked position, compiled the same way;
* ``read``: the same slot views only read (each converted to float32 and summed), compiled
  the same way: what a loop over those bytes costs here with no attention arithmetic;

all given the slots as arguments (not constants inductor could fold), timed round by round
(interleaved; the best round's median is reported, since a shared machine only adds time).
The rows are of different ages, as at eight streams: row ``r`` of ``b`` attends the first
``length · (1 − ¾ · r / (b − 1))`` positions (the first row is the longest, the last a quarter
of it). The bytes are ``2 · layers · batch · heads · length · head_dim · 2``, what a dense
attention reads; the rows' own positions are a part of that (``reached``). GB/s is the dense
bytes over the median time. ``attention / read`` says how far the dense attention is from the
bytes' cost, ``operator / attention`` what reading each row only as far as it reaches buys.

Writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.harness.engine_bench import command, report_header
from bench.harness.machine import describe_machine
from server.engine.chattts.step import decode_attention
from server.engine.chattts.step.kv import SlotKV, kv_dtype
from server.engine.chattts.step.llama import Attention, math_attention

PARTS = ("attention", "decode_attention", "read")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"1x128,8x320"`` → ``[(1, 128), (8, 320)]`` (batch, attention length)."""
    shapes = []
    for item in text.split(","):
        batch, length = item.lower().split("x")
        shapes.append((int(batch), int(length)))
    return shapes


def over_layers(attend: Attention) -> Callable[..., torch.Tensor]:
    """``attend`` once per layer over slots ``[0, b)`` and positions ``[0, length)``, as the step does."""

    def run(
        q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor, length: int
    ) -> torch.Tensor:
        b, out = q.shape[0], q
        for k, v in zip(keys, values, strict=True):
            out = attend(out, k[:b, :, :length], v[:b, :, :length], mask, 0.125)
        return out

    return run


def row_ends(batch: int, length: int) -> list[int]:
    """Each row's attended positions: the first row the whole length, the last a quarter of it."""
    if batch == 1:
        return [length]
    return [round(length * (1 - 0.75 * r / (batch - 1))) for r in range(batch)]


def read_layers(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor, length: int
) -> torch.Tensor:
    """The same slot views read once each (float32 sums): the bytes without the attention."""
    b, total = q.shape[0], q.new_zeros((), dtype=torch.float32)
    for k, v in zip(keys, values, strict=True):
        total = total + k[:b, :, :length].float().sum() + v[:b, :, :length].float().sum()
    return total


def _median_ms(fn: Callable[[], Any], iterations: int) -> float:
    times = []
    for _ in range(iterations):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1e3)
    return sorted(times)[len(times) // 2]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Compile every part, time every shape for ``--rounds`` rounds, return the rows."""
    if not decode_attention.load():
        raise SystemExit("the C++ decode attention did not build here (see the log)")
    shapes = parse_shapes(args.shapes)
    dtype = kv_dtype(torch.bfloat16, torch.device("cpu"), compiled=True)
    kv = SlotKV(
        layers=args.layers,
        slots=max(args.slots, max(b for b, _ in shapes)),
        kv_heads=args.heads,
        max_len=max(args.max_len, max(n for _, n in shapes)),
        head_dim=args.head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    generator = torch.Generator().manual_seed(0)
    widest, longest = max(b for b, _ in shapes), max(n for _, n in shapes)
    for buffer in (*kv.keys, *kv.values):  # random, as live rows hold: untouched pages read as zeros
        filled = buffer[:widest, :, :longest]
        filled.copy_(torch.randn(filled.shape, generator=generator).to(dtype))
    compiled = {
        "attention": torch.compile(over_layers(math_attention), dynamic=True),
        "decode_attention": torch.compile(over_layers(decode_attention.decode_attention), dynamic=True),
        "read": torch.compile(read_layers, dynamic=True),
    }
    inputs = {}
    compile_s = {}
    with torch.inference_mode():
        for batch, length in shapes:
            q = torch.randn(batch, args.heads, 1, args.head_dim, generator=generator).to(torch.bfloat16)
            ends = torch.tensor(row_ends(batch, length)).view(batch, 1)
            mask = (torch.arange(length).unsqueeze(0) < ends).view(batch, 1, 1, length)
            inputs[(batch, length)] = (q, mask)
            for part, fn in compiled.items():
                began = time.perf_counter()
                fn(q, kv.keys, kv.values, mask, length)
                compile_s[f"{part} {batch}x{length}"] = time.perf_counter() - began
        rounds: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for (batch, length), (q, mask) in inputs.items():
                for part, fn in compiled.items():
                    key = f"{part} {batch}x{length}"

                    def call(
                        fn: Any = fn, q: torch.Tensor = q, mask: torch.Tensor = mask, n: int = length
                    ) -> Any:
                        return fn(q, kv.keys, kv.values, mask, n)

                    rounds.setdefault(key, []).append(_median_ms(call, args.iterations))
    rows = []
    for batch, length in shapes:
        nbytes = 2 * args.layers * batch * args.heads * length * args.head_dim * dtype.itemsize
        reached = nbytes * sum(row_ends(batch, length)) // (batch * length)
        row: dict[str, Any] = {"batch": batch, "length": length, "bytes": nbytes, "reached_bytes": reached}
        for part in PARTS:
            best = min(rounds[f"{part} {batch}x{length}"])
            row[part] = {
                "ms": best,
                "gb_s": nbytes / best / 1e6,
                "rounds_ms": rounds[f"{part} {batch}x{length}"],
            }
        row["attention_over_read"] = row["attention"]["ms"] / row["read"]["ms"]
        row["operator_over_attention"] = row["decode_attention"]["ms"] / row["attention"]["ms"]
        rows.append(row)
    return {"kv_dtype": str(dtype).removeprefix("torch."), "rows": rows, "first_call_s": compile_s}


def render(report: dict[str, Any]) -> str:
    """The Markdown result."""
    lines = report_header("The compiled step's attention against reading its bytes", report)
    cfg = report["config"]
    lines += [
        f"KV slots: {report['kv_dtype']}, {cfg['layers']} layers, {cfg['heads']} heads of {cfg['head_dim']}, "
        f"{cfg['slots']} slots of {cfg['max_len']} positions; best of {cfg['rounds']} rounds, "
        f"median of {cfg['iterations']} calls each.",
        "",
        "| batch | attention length | MB (dense) | MB (rows' own) | attention ms | GB/s | read ms | GB/s "
        "| attention / read | operator ms | operator / attention |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        att, read, op = row["attention"], row["read"], row["decode_attention"]
        lines.append(
            f"| {row['batch']} | {row['length']} | {row['bytes'] / 1e6:.1f} "
            f"| {row['reached_bytes'] / 1e6:.1f} "
            f"| {att['ms']:.2f} | {att['gb_s']:.1f} | {read['ms']:.2f} | {read['gb_s']:.1f} "
            f"| {row['attention_over_read']:.2f} | {op['ms']:.2f} | {row['operator_over_attention']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    """Measure, write ``OUT.json`` and ``OUT.md``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="1x128,4x256,8x320", help="BATCHxLENGTH, comma-separated")
    parser.add_argument("--layers", type=int, default=20, help="ChatTTS's GPT: 20")
    parser.add_argument("--heads", type=int, default=12, help="key/value heads (ChatTTS's GPT: 12)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16, help="the engine's default --max-batch")
    parser.add_argument(
        "--max-len",
        type=int,
        default=3120,
        help="positions per slot, the row stride (the engine's default: longest prompt bucket + 2048)",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="path without suffix: writes .json and .md")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict[str, Any] = {
        "command": command("bench.studies.attention"),
        "machine": describe_machine(),
        "torch_threads": torch.get_num_threads(),
        "shared_machine": "not stated (the load average at start says what else ran)",
        "config": {
            k: getattr(args, k)
            for k in ("layers", "heads", "head_dim", "slots", "max_len", "rounds", "iterations")
        },
    }
    report.update(measure(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
