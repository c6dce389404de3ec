"""The markdown summary of a run (the table in ``bench/README.md``) and the issue #4 ratios."""

from __future__ import annotations

from typing import Any


def _fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _find(
    results: dict[str, Any], system: str, concurrency: int, fmt: str | None = None
) -> dict[str, Any] | None:
    scenarios: list[dict[str, Any]] = results["scenarios"]
    for s in scenarios:
        same = s["system"] == system and s["mode"] == "closed" and s["concurrency"] == concurrency
        if same and (fmt is None or s["format"] == fmt):
            return s
    return None


def throughput_ratios(results: dict[str, Any], concurrency: int = 8, fmt: str = "pcm16") -> dict[str, Any]:
    """Issue #4: steady audio-s per wall-s of the server at ``concurrency`` vs one stream and vs the engine.

    Targets: ≥ 3× a single stream through the server; ≥ 0.9× the engine
    stepping the same number of sequences in-process.
    """

    def steady(s: dict[str, Any] | None) -> float | None:
        return s["summary"]["throughput"]["steady_audio_s_per_wall_s"] if s else None

    def per_cpu(s: dict[str, Any] | None) -> float | None:
        return s["summary"]["throughput"]["audio_s_per_cpu_s"] if s else None

    server_n, server_1 = _find(results, "server", concurrency, fmt), _find(results, "server", 1, fmt)
    engine_n = _find(results, "engine-direct", concurrency)
    many, one, engine = steady(server_n), steady(server_1), steady(engine_n)
    many_cpu, one_cpu, engine_cpu = per_cpu(server_n), per_cpu(server_1), per_cpu(engine_n)
    return {
        "concurrency": concurrency,
        "format": fmt,
        "server_audio_s_per_wall_s": many,
        "server_single_audio_s_per_wall_s": one,
        "engine_direct_audio_s_per_wall_s": engine,
        "server_audio_s_per_cpu_s": many_cpu,
        "server_single_audio_s_per_cpu_s": one_cpu,
        "engine_direct_audio_s_per_cpu_s": engine_cpu,
        "vs_single_cpu": (many_cpu / one_cpu) if many_cpu and one_cpu else None,
        "vs_engine_cpu": (many_cpu / engine_cpu) if many_cpu and engine_cpu else None,
        "vs_single": (many / one) if many and one else None,
        "vs_single_target": 3.0,
        "vs_engine": (many / engine) if many and engine else None,
        "vs_engine_target": 0.9,
    }


def markdown(results: dict[str, Any]) -> str:
    """A table with one row per scenario, then the issue #4 ratios."""
    jitter = results["settings"]["jitter_ms"]
    j = jitter[0] if jitter else None
    advice = bool(results["settings"].get("advice"))
    head = (
        "| system | load | format | streams (ok/err/cut) | TTFA p50 / p90 / p99 / max (s) "
        "| first non-silent p50 / p90 (s) "
        "| RTF p50 / p90 | max gap p90 (s) "
        + (f"| underrun streams @{j:g} ms, stall p90 (s) " if j is not None else "")
        + (
            "| advised listener: underrun streams, stall p90 (s), start p50 / p90 (s) "
            "vs fixed start p50 / p90 (s), buffer p50 / max (ms) "
            if advice
            else ""
        )
        + "| audio-s per wall-s (steady) | audio-s per CPU-s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in results["scenarios"]:
        m = s["summary"]
        ttfa, ttfs, rtf = m["ttfa_s"], m["ttfs_s"], m["rtf"]
        cells = [
            s["system"],
            s["label"],
            s["format"],
            f"{m['streams']} ({m['ok']}/{m['error_streams']}/{m['cut']})",
            " / ".join(_fmt(ttfa[k]) for k in ("p50", "p90", "p99", "max")),
            " / ".join(_fmt(ttfs[k]) for k in ("p50", "p90")),
            " / ".join(_fmt(rtf[k]) for k in ("p50", "p90")),
            _fmt(m["max_gap_s"]["p90"]),
        ]
        if j is not None:
            lst = next((x for x in m["listener"] if x["threshold_ms"] == j), None)
            cells.append(
                f"{lst['streams_with_underruns']}/{m['streams']}, {_fmt(lst['stall_s']['p90'])}"
                if lst
                else "–"
            )
        if advice:
            cells.append(_advised(m, j))
        cells.append(_fmt(m["throughput"]["steady_audio_s_per_wall_s"]))
        cells.append(_fmt(m["throughput"]["audio_s_per_cpu_s"]))
        lines.append("| " + " | ".join(cells) + " |")
    errors = {
        s["system"] + " " + s["label"]: s["summary"]["errors"]
        for s in results["scenarios"]
        if s["summary"]["errors"]
    }
    if errors:
        lines += ["", "Errors by code: " + "; ".join(f"{k}: {v}" for k, v in errors.items())]
    ratios = results.get("issue4")
    if ratios and ratios.get("server_audio_s_per_wall_s") is not None:
        lines += [
            "",
            f"Issue #4 (c={ratios['concurrency']}, {ratios['format']}): server "
            f"{_fmt(ratios['server_audio_s_per_wall_s'])} audio-s/s vs single stream "
            f"{_fmt(ratios['server_single_audio_s_per_wall_s'])} → **{_fmt(ratios['vs_single'])}×** "
            "(target ≥ 3×); "
            f"vs engine in-process {_fmt(ratios['engine_direct_audio_s_per_wall_s'])} → "
            f"**{_fmt(ratios['vs_engine'])}×** (target ≥ 0.9×). Per CPU-second (robust to other load "
            f"on the machine): server {_fmt(ratios['server_audio_s_per_cpu_s'])} vs single stream "
            f"{_fmt(ratios['server_single_audio_s_per_cpu_s'])} → **{_fmt(ratios['vs_single_cpu'])}×**; "
            f"vs engine {_fmt(ratios['engine_direct_audio_s_per_cpu_s'])} → "
            f"**{_fmt(ratios['vs_engine_cpu'])}×**.",
        ]
    for skip in results.get("skipped", []):
        lines.append(f"\nSkipped: {skip['what']}: {skip['why']}")
    return "\n".join(lines) + "\n"


def _advised(summary: dict[str, Any], fixed_ms: float | None) -> str:
    """The advised listener's cell: its stalls and start, beside the fixed buffer's start."""
    a = summary.get("advised")
    if not a:
        return "–"
    fixed = next((x for x in summary["listener"] if x["threshold_ms"] == fixed_ms), None)
    fixed_start = " / ".join(_fmt(fixed["start_s"][k]) for k in ("p50", "p90")) if fixed else "–"
    return (
        f"{a['streams_with_underruns']}/{summary['streams']}, {_fmt(a['stall_s']['p90'])}, "
        f"{' / '.join(_fmt(a['start_s'][k]) for k in ('p50', 'p90'))} vs {fixed_start}, "
        f"{_fmt(a['threshold_ms']['p50'], 0)} / {_fmt(a['threshold_ms']['max'], 0)}"
    )
