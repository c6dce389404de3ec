"""Scenario summaries: percentiles, throughput, errors by code."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from bench.harness.latency import StreamRecord

PERCENTILES = (50, 90, 99)


def distribution(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """``n``, ``mean``, ``p50``/``p90``/``p99`` (numpy's linear interpolation) and ``max``."""
    data = np.array([v for v in values if v is not None], dtype=np.float64)
    if data.size == 0:
        return {"n": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    return {
        "n": int(data.size),
        "mean": float(data.mean()),
        **{f"p{p}": float(np.percentile(data, p)) for p in PERCENTILES},
        "max": float(data.max()),
    }


def audio_in_window(records: Sequence[StreamRecord], start: float, stop: float) -> float:
    """Audio seconds whose frames arrived within ``[start, stop]``."""
    return sum(n / r.sample_rate for r in records for t, n in r.frames if start <= t <= stop)


def summarize(
    records: Sequence[StreamRecord],
    metrics: Sequence[dict[str, Any]],
    *,
    t_start: float,
    t_stop: float,
    t_end: float,
    cpu_s: float | None = None,
    client_cpu_s: float | None = None,
) -> dict[str, Any]:
    """The scenario's overall numbers.

    ``throughput.audio_s_per_wall_s`` divides all audio by the whole run
    (first request to last ``done``); ``steady_audio_s_per_wall_s`` counts
    only audio that arrived while the offered load was held
    (``[t_start, t_stop]``: in a closed loop, while all N streams were in
    flight), so the drain at the end does not dilute it.
    ``audio_s_per_cpu_s`` divides by the CPU seconds the system under test
    used, when known (a server the harness started, or an in-process run).
    ``client_cores`` is the load client's own CPU seconds (this process, every thread) over
    the run: near one, the client (one Python process) and not the server may be the limit.
    """
    errors: Counter[str] = Counter(code for r in records for code in r.errors)
    total_audio = sum(m["audio_s"] for m in metrics)
    wall = max(t_end - t_start, 1e-9)
    window = max(t_stop - t_start, 1e-9)
    gaps = [g for m in metrics for g in m["gaps_s"]]
    thresholds = sorted({entry["threshold_ms"] for m in metrics for entry in m["listener"]})
    listener = []
    for ms in thresholds:
        runs = [e for m in metrics for e in m["listener"] if e["threshold_ms"] == ms]
        listener.append(
            {
                "threshold_ms": ms,
                "start_s": distribution(e["start_s"] for e in runs),
                "underruns_per_stream": distribution(e["underruns"] for e in runs),
                "streams_with_underruns": sum(1 for e in runs if e["underruns"]),
                "stall_s": distribution(e["stall_s"] for e in runs),
            }
        )
    advised = [m["advised"] for m in metrics if m.get("advised")]
    extra: dict[str, Any] = {}
    if any("advised" in m for m in metrics):
        extra["advised"] = {
            "threshold_ms": distribution(e["threshold_ms"] for e in advised),
            "start_s": distribution(e["start_s"] for e in advised),
            "underruns_per_stream": distribution(e["underruns"] for e in advised),
            "streams_with_underruns": sum(1 for e in advised if e["underruns"]),
            "stall_s": distribution(e["stall_s"] for e in advised),
        }
    return extra | {
        "streams": len(records),
        "ok": sum(1 for r in records if r.ok),
        "capped": sum(1 for r in records if r.capped),
        "cut": sum(1 for r in records if r.cut),
        "errors": dict(sorted(errors.items())),
        "error_streams": sum(1 for r in records if r.errors),
        "ttfa_s": distribution(m["ttfa_s"] for m in metrics),
        "ttfs_s": distribution(m["ttfs_s"] for m in metrics),
        "leading_silence_s": distribution(m["leading_silence_s"] for m in metrics),
        "rtf": distribution(m["rtf"] for m in metrics),
        "max_gap_s": distribution(m["max_gap_s"] for m in metrics),
        "gap_s": distribution(gaps),
        "connect_s": distribution(m["connect_s"] for m in metrics),
        "audio_s": distribution(m["audio_s"] for m in metrics),
        "listener": listener,
        "throughput": {
            "audio_s": total_audio,
            "wall_s": wall,
            "audio_s_per_wall_s": total_audio / wall,
            "window_s": window,
            "steady_audio_s_per_wall_s": audio_in_window(records, t_start, t_stop) / window,
            "cpu_s": cpu_s,
            "audio_s_per_cpu_s": (total_audio / cpu_s) if cpu_s else None,
            "client_cpu_s": client_cpu_s,
            "client_cores": client_cpu_s / wall if client_cpu_s is not None else None,
        },
    }
