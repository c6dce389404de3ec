"""The verdicts and the markdown of ``python -m bench.gpu`` (issue #15's GPU targets)."""

from __future__ import annotations

from typing import Any

#: Targets on an H200-class GPU (issue #15, acceptance 6).
TTFA_P50_S, TTFA_P99_S, TTFA_AT, MIN_STREAMS = 0.100, 0.250, 16, 64


def _scenario(results: dict[str, Any], concurrency: int) -> dict[str, Any] | None:
    ttfa = results["stages"].get("ttfa", {})
    for s in ttfa.get("scenarios", []):
        if s.get("concurrency") == concurrency and "ttfa_p50_s" in s:
            return dict(s)
    return None


def verdicts(results: dict[str, Any]) -> dict[str, Any]:
    """Each target: the measured value and whether it was met (``None``: not measured)."""
    out: dict[str, Any] = {}
    tests = results["stages"].get("tests", {})
    if "counts" in tests:
        out["model_tests_pass"] = tests.get("returncode") == 0
    at16 = _scenario(results, TTFA_AT)
    if at16 and at16["ttfa_p50_s"] is not None:
        out["ttfa_p50_at_16_s"] = {
            "value": at16["ttfa_p50_s"],
            "target": TTFA_P50_S,
            "met": at16["ttfa_p50_s"] <= TTFA_P50_S,
        }
        out["ttfa_p99_at_16_s"] = {
            "value": at16["ttfa_p99_s"],
            "target": TTFA_P99_S,
            "met": at16["ttfa_p99_s"] <= TTFA_P99_S,
        }
    search = results["stages"].get("search", {})
    if "largest_zero_underrun_concurrency" in search:
        best = search["largest_zero_underrun_concurrency"]
        out["zero_underrun_streams"] = {"value": best, "target": MIN_STREAMS, "met": best >= MIN_STREAMS}
    return out


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{1000 * value:.0f}"


def _met(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "not measured"
    return "met" if entry["met"] else "**not met**"


def render(results: dict[str, Any]) -> str:
    """The markdown report (written after every stage, so it may be partial)."""
    v, ver, stages = results.get("verdicts", {}), results.get("versions", {}), results["stages"]
    m = results["machine"]
    lines = [
        "# python -m bench.gpu",
        "",
        f"Command: `{results['command']}` ({results.get('elapsed_s', 0):.0f} s)",
        "",
        f"Device: **{ver.get('gpu') or ver.get('device')}** ({ver.get('gpu_memory_gib', '—')} GiB); "
        f"torch {ver.get('torch')}, CUDA {ver.get('cuda')}, cuDNN {ver.get('cudnn', '—')}; "
        f"GPUs seen by nvidia-smi: {m.get('gpus') or 'none'}; CPU {m['cpu_model']} × {m['cpu_cores']}; "
        f"model {results['settings'].get('model_dir')}.",
        "",
        "| stage | status | time (s) | note |",
        "|---|---|---|---|",
    ]
    for name, s in stages.items():
        note = s.get("error") or s.get("why") or s.get("summary") or ""
        # A table cell holds one line: an error's traceback keeps its last line (the exception).
        text = str(note).strip().splitlines()
        cell = (text[-1] if s.get("error") and text else " ".join(text)).replace("|", "/")[:160]
        lines.append(f"| {name} | {s['status']} | {s.get('elapsed_s', '')} | {cell} |")
    lines += [
        "",
        "## Targets (H200 class, issue #15)",
        "",
        "| target | measured | verdict |",
        "|---|---|---|",
    ]
    p50, p99, streams = v.get("ttfa_p50_at_16_s"), v.get("ttfa_p99_at_16_s"), v.get("zero_underrun_streams")
    lines.append(
        f"| first audio p50 ≤ 100 ms at 16 streams | {_ms(p50['value']) if p50 else '—'} ms | {_met(p50)} |"
    )
    lines.append(
        f"| first audio p99 ≤ 250 ms at 16 streams | {_ms(p99['value']) if p99 else '—'} ms | {_met(p99)} |"
    )
    best = streams["value"] if streams else "—"
    lines.append(f"| ≥ 64 real-time streams, zero underruns | {best} | {_met(streams)} |")
    tests = stages.get("tests", {})
    if tests.get("failures"):
        reasons = tests.get("failure_reasons", {})
        lines += ["", "Model tests that failed on the device:", ""]
        lines += [f"- `{f}`: {reasons.get(f) or 'see failure_text'}" for f in tests["failures"]]
    step = stages.get("step", {})
    if step.get("rows"):
        lines += [
            "",
            f"## Token step (attention length {step['rows'][0]['length']}, {step.get('dtype')})",
            "",
        ]
        lines += ["| batch | eager ms | graphs ms | speed-up | graphs ms per row |", "|---|---|---|---|---|"]
        for r in step["rows"]:
            g = r.get("graphs_ms")
            speed = f"{r['eager_ms'] / g:.1f}×" if g else "—"
            per_row = f"{r['graphs_ms_per_row']:.3f}" if g else "—"
            lines.append(
                f"| {r['batch']} | {r['eager_ms']:.2f} | {f'{g:.2f}' if g else '—'} | {speed} | {per_row} |"
            )
        extra = step["extra"]
        lines.append(
            f"\nLoad (graph capture included): {step.get('load_s', 0):.1f} s, warm-up "
            f"{step.get('warmup_s', 0):.1f} s; KV cache "
            f"{int(extra['kv_cache_bytes']) / 2**30:.2f} GiB for {extra['kv_slots']} slots; token step "
            f"{extra.get('token_step')}, projections {extra.get('projections')}."
        )
        if "token_step_fallback" in extra:
            lines.append(f"\n**The token step fell back to eager:** {extra['token_step_fallback']}")
    probes = stages.get("search", {}).get("probes") or stages.get("ttfa", {}).get("scenarios") or []
    if probes:
        listener = results["settings"].get("listener_ms")
        lines += ["", "## Server scenarios (closed loop, the dev model above)", ""]
        head = (
            "| streams | first audio p50 / p99 (ms) | RTF p50 | audio-s per s "
            f"| underrun streams @{listener:g} / @100 ms | errors, cut |"
        )
        lines += [head, "|---|---|---|---|---|---|"]
        scenarios = [
            *stages.get("ttfa", {}).get("scenarios", []),
            *stages.get("search", {}).get("probes", []),
        ]
        seen = {p["concurrency"]: p for p in scenarios if "streams" in p}
        for c in sorted(seen):
            p = seen[c]
            underruns = f"{p['underrun_streams']}/{p['streams']} / {p['underrun_streams_100ms']}"
            lines.append(
                f"| {c} | {_ms(p['ttfa_p50_s'])} / {_ms(p['ttfa_p99_s'])} | {p['rtf_p50'] or 0:.2f} | "
                f"{p['audio_s_per_wall_s']:.1f} | {underruns} | {p['errors'] or 0}, {p['cut']} |"
            )
        busy = [seen[c] for c in sorted(seen) if seen[c].get("engine_busy") is not None]
        if busy:
            lines += [
                "",
                "The inference thread in each scenario (from `/metrics`): share of the wall time in "
                "engine steps, token steps per engine step, rows per step.",
                "",
                "| streams | engine busy | tokens per block | rows per step |",
                "|---|---|---|---|",
            ]
            for p in busy:
                blocks, rows = p["tokens_per_block"], p["rows_per_step"]
                lines.append(f"| {p['concurrency']} | {p['engine_busy']:.2f} | {blocks} | {rows} |")
    lines += _engine_table(stages)
    return "\n".join(lines) + "\n"


def _engine_table(stages: dict[str, Any]) -> list[str]:
    """The engine stage's closed loops beside the server scenario at the same concurrency."""
    runs = stages.get("engine", {}).get("runs", {})
    if not runs:
        return []
    scenarios = [*stages.get("ttfa", {}).get("scenarios", []), *stages.get("search", {}).get("probes", [])]
    server = {p["concurrency"]: p for p in scenarios if "audio_s_per_wall_s" in p}
    lines = [
        "",
        "## The engine alone against the server",
        "",
        "The engine in-process (`bench.gpu.engine`: closed loops after an untimed start, EOS banned) "
        "at each level, beside the server scenario at that concurrency (the server runs the "
        "default schedule, so only that row has a ratio).",
        "",
        "| block schedule | rows | engine audio-s per s | engine tokens per block "
        "| server audio-s per s | server tokens per block | server / engine |",
        "|---|---|---|---|---|---|---|",
    ]
    for schedule, run in runs.items():
        for level, loop in run["closed"].items():
            engine_rate = loop["audio_s_per_wall_s"]
            scenario = server.get(int(level)) if run.get("default") else None
            if scenario:
                ratio = f"{scenario['audio_s_per_wall_s'] / engine_rate:.2f}×"
                theirs = f"{scenario['audio_s_per_wall_s']:.1f} | {scenario.get('tokens_per_block', '—')}"
            else:
                ratio, theirs = "—", "— | —"
            blocks = loop["tokens_per_block"]
            lines.append(f"| {schedule} | {level} | {engine_rate:.1f} | {blocks:.2f} | {theirs} | {ratio} |")
    return lines
