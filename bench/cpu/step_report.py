"""The step part of :mod:`bench.cpu`'s report: its rows, where a step's time goes, and the step's targets.

Reads :mod:`bench.cpu.step`'s JSON (``result["step"]``): every row is ``name@batch`` with the wall
and CPU ms of each round and the fastest of them.
"""

from __future__ import annotations

from typing import Any

from bench.cpu.cells import fmt, load_note
from bench.cpu.compiled import paired_floor_row

#: What real time needs on ChatTTS: 46.9 audio tokens a second of audio, per stream.
REALTIME_MS_PER_TOKEN = 1000 / (24_000 / 512)
STEP_ROWS = (
    ("floor", "memory floor: one bf16 product over all GPT weights (faster of plain and packed)"),
    ("floor-int8", "int8 memory floor: one w8a8 product over as many int8 weights (FBGEMM or VNNI, faster)"),
    ("products-dense", "the 140 projections one by one, bf16 `F.linear` (as before #23)"),
    ("products-onednn-bf16", "the 140 projections, oneDNN-prepacked bf16"),
    ("products-int8", "the 140 projections, weight-only int8"),
    ("products-w8a8", "the 140 projections, int8 weights × per-row int8 activations (VNNI, else FBGEMM)"),
    ("transformers", "transformers' `LlamaModel`, eager, its own cache"),
    ("transformers-compiled", "the same, `torch.compile` (default mode)"),
    ("step-dense", "our whole token step, before #23 (dense bf16 projections)"),
    ("step-onednn-bf16", "our whole token step, after (default: prepacked bf16)"),
    ("step-int8", "our whole token step, `--quantize int8`"),
    ("step-w8a8", "our whole token step, `--quantize w8a8`"),
    ("step-compiled", "our whole token step, `--compile-step on` (timed after the rows above)"),
    ("step-compiled-int8", "our whole token step, `--compile-step on --quantize int8` (timed after)"),
    ("step-compiled-w8a8", "our whole token step, `--compile-step on --quantize w8a8` (timed after)"),
    ("step-compiled-w8a8-ahead", "our whole token step, `--compile-step ahead --quantize w8a8`, the default"),
    ("step-compiled-w8a8-fbgemm-ahead", "the same, FBGEMM's products (the default before the VNNI kernel)"),
)
#: The projection forms :mod:`bench.cpu.step` measures the step with.
STEP_FORMS = ("dense", "onednn-bf16", "int8", "w8a8")
SPLIT_COLUMNS = ("projections", "attention", "kv_write", "llama_rest", "step_rest", "total")
#: How the floor beside a compiled row was timed (:mod:`bench.cpu.compiled`).
PAIRED = "same process, alternating with the step in every round"


def best(step: dict[str, Any], name: str, batch: int, key: str = "best_ms") -> float | None:
    """Row ``name``'s fastest round at ``batch`` (``key``: or its CPU ms); ``None`` if not measured."""
    rows = step["rows"]
    forms = {"floor": ("plain", "packed"), "floor-int8": ("fbgemm", "vnni")}.get(name)
    if forms is not None:  # a floor is the fastest of its forms (a run before the forms: the one row)
        keys = [f"{name}-{form}@{batch}" for form in forms] + [f"{name}@{batch}"]
        values = [rows[k].get(key) for k in keys if k in rows]
        values = [v for v in values if v is not None]
        return min(values) if values else None
    entry = rows.get(f"{name}@{batch}")
    return entry.get(key) if entry else None


#: Issue #46's margin: the batch-1 compiled w8a8 step at most this many times its int8 floor.
INT8_FLOOR_RATIO = 1.6


def step_targets(step: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """The step's targets: (what, the numbers, met)."""
    rows: list[tuple[str, str, bool | None]] = []
    for batch in (1, 8):
        ours, hf = best(step, "step-onednn-bf16", batch), best(step, "transformers", batch)
        cpu = [best(step, n, batch, "best_cpu_ms") for n in ("step-onednn-bf16", "transformers")]
        met = None if ours is None or hf is None else ours <= hf
        what = f"our bf16 step ≤ transformers' at batch {batch}"
        numbers = f"{fmt(ours)} ms vs {fmt(hf)} ms (CPU time: {fmt(cpu[0])} vs {fmt(cpu[1])} ms)"
        rows.append((what, numbers, met))
    return rows + int8_floor_target(step)


def int8_floor_target(step: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """The batch-1 compiled w8a8 step ÷ the int8 weight-read floor of the same run (none if unmeasured).

    The default's step (built ahead of time) where the run has it, else the lazily compiled one.
    Its floor is the one timed beside it, round by round in its process
    (:func:`~bench.cpu.compiled.paired_floor_row`); a run from before that pairing has only the
    floor of the step rows' process, timed minutes earlier.
    """
    name = next((n for n in ("step-compiled-w8a8-ahead", "step-compiled-w8a8") if best(step, n, 1)), None)
    if name is None:
        return []
    ours, paired = best(step, name, 1), best(step, paired_floor_row(name), 1)
    floor = paired if paired is not None else best(step, "floor-int8", 1)
    if ours is None or floor is None:
        return []
    ratio = ours / floor
    how = "timed beside it in each round" if paired is not None else "timed in the step rows' process"
    numbers = f"{fmt(ours, 2)} / {fmt(floor, 2)} ms = {ratio:.2f}× (fastest round of each; the floor {how})"
    if paired is not None:
        steps = step["rows"][f"{name}@1"]["ms"]
        floors = step["rows"][f"{paired_floor_row(name)}@1"]["ms"]
        per_round = ", ".join(f"{s / f:.2f}" for s, f in zip(steps, floors, strict=True))
        numbers += f"; each round {per_round}"
    return [
        (
            f"batch-1 compiled w8a8 step ≤ {INT8_FLOOR_RATIO:g}× the int8 floor",
            numbers,
            ratio <= INT8_FLOOR_RATIO,
        )
    ]


def step_tables(step: dict[str, Any]) -> list[str]:
    """The step rows, the split of each eager form's step, and the profiler's top operators."""
    batches = step["batches"]
    head = " | ".join(f"batch {b}" for b in batches)
    lines = [
        "",
        f"## One token step: wall ms (CPU ms of both threads), fastest of "
        f"{len(step['loadavg_after_rounds']) // len(batches)} interleaved rounds; attention over "
        f"{step['length']} positions; {step['weights'] / 1e6:.0f} M weights",
        "",
        f"| row | {head} |",
        "|---|" + "---|" * len(batches),
    ]
    for name, label in STEP_ROWS:
        for row, text in (
            (name, label),
            (paired_floor_row(name), f"↳ the int8 floor timed beside it, {PAIRED}"),
        ):
            values = [best(step, row, b) for b in batches]
            cpu = [best(step, row, b, "best_cpu_ms") for b in batches]
            if any(v is not None for v in values):
                cells = " | ".join(f"{fmt(v)} ({fmt(c)})" for v, c in zip(values, cpu, strict=True))
                lines.append(f"| {text} | {cells} |")
    budget = " | ".join(f"{REALTIME_MS_PER_TOKEN * b:.1f}" for b in batches)
    lines.append(f"| real time: {REALTIME_MS_PER_TOKEN:.1f} ms per token per stream | {budget} |")
    loads = ", ".join(load_note(x) for x in step["loadavg_after_rounds"])
    lines += ["", f"Load average after each round and batch: {loads}."]
    if step.get("compile_s") is not None:
        lines.append(f"`torch.compile` of transformers' Llama: {step['compile_s']:.0f} s for these batches.")
    lines += [
        "",
        "## Where one token step's time goes, ms (the fastest split of the rounds)",
        "",
        "| step | batch | projections | attention | KV writes | rest of the Llama | heads, sampling, rest "
        "| total |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for form in STEP_FORMS:
        for b in batches:
            split = step["splits"].get(f"step-{form}@{b}")
            if split:
                lines.append(f"| {form} | {b} | " + " | ".join(fmt(split[c]) for c in SPLIT_COLUMNS) + " |")
    lines += ["", "## Top operators of one step (`torch.profiler`, self CPU ms, calls)", ""]
    for form in STEP_FORMS:
        for b in (batches[0], batches[-1]):
            ops = step["profiles"].get(f"step-{form}@{b}", [])[:6]
            text = "; ".join(f"`{o['op']}` {o['self_ms']:.1f} ({o['calls']})" for o in ops)
            lines.append(f"- {form}, batch {b}: {text}")
    return lines
