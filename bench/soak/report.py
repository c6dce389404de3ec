"""The soak's judgement, plot and markdown: the samples and per-request outcomes into its verdict.

Used by :mod:`bench.soak`. The samples come from :mod:`bench.harness.sampler`; :func:`analyse_samples`
turns them and the per-request outcomes into the numbers the soak acceptance is judged on.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness.sampler import Sample

#: Acceptance: RSS growth after warm-up must stay under this many percent.
RSS_GROWTH_LIMIT_PCT = 5.0


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _pct(new: float | None, base: float | None) -> float | None:
    if new is None or base is None or base == 0:
        return None
    return (new - base) / base * 100.0


def _slope_per_hour(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of (t, value) in value units per hour."""
    if len(points) < 3:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return cov / var * 3600.0


def analyse_samples(
    samples: Sequence[Sample], warmup_end_t: float, load_end_t: float, window_s: float = 60.0
) -> dict[str, Any]:
    """RSS and fd figures of a soak run.

    The post-warm-up window is the load phase from ``warmup_end_t`` to ``load_end_t``.
    ``rss.growth_pct`` compares its first and last sample; ``rss.growth_robust_pct``
    the medians of its first and last ``window`` seconds (``window_s``, at most a
    quarter of the window). File descriptors are compared while idle: after the load
    and the resume TTL, with no connection open, the fewest open must not exceed the
    fewest open before the load. A leaked descriptor stays open in every later sample, so
    the minimum shows it; a socket still closing at one sample (the sampler's own
    ``/metrics`` request, a client's last connection, on a loaded machine) is no leak and
    must not fail the run (a maximum counted it: idle 17, then a maximum of 18).
    """
    post = [s for s in samples if s.phase == "load" and warmup_end_t <= s.t <= load_end_t]
    idle_before = [s.fds for s in samples if s.phase == "idle_before"]
    idle_after = [s.fds for s in samples if s.phase == "idle_after"]
    mib = 1024.0 * 1024.0
    result: dict[str, Any] = {
        "warmup_end_s": warmup_end_t,
        "load_end_s": load_end_t,
        "post_warmup_samples": len(post),
    }
    if not post:
        result["rss"] = result["fds"] = None
        return result
    duration = post[-1].t - post[0].t
    window = max(min(window_s, duration / 4.0), 0.0)
    first = [s for s in post if s.t <= post[0].t + window]
    last = [s for s in post if s.t >= post[-1].t - window]
    rss_first_med = _median([s.rss_bytes for s in first])
    rss_last_med = _median([s.rss_bytes for s in last])
    all_rss = [s.rss_bytes for s in samples]
    result["rss"] = {
        "idle_before_mib": _median([s.rss_bytes / mib for s in samples if s.phase == "idle_before"]),
        "baseline_mib": post[0].rss_bytes / mib,
        "end_mib": post[-1].rss_bytes / mib,
        "growth_pct": _pct(post[-1].rss_bytes, post[0].rss_bytes),
        "window_s": window,
        "first_window_median_mib": rss_first_med / mib if rss_first_med is not None else None,
        "last_window_median_mib": rss_last_med / mib if rss_last_med is not None else None,
        "growth_robust_pct": _pct(rss_last_med, rss_first_med),
        "post_warmup_max_mib": max(s.rss_bytes for s in post) / mib,
        "post_warmup_min_mib": min(s.rss_bytes for s in post) / mib,
        "slope_mib_per_hour": (
            None if (v := _slope_per_hour([(s.t, s.rss_bytes / mib) for s in post])) is None else v
        ),
        "max_mib": max(all_rss) / mib,
        "idle_after_mib": _median([s.rss_bytes / mib for s in samples if s.phase == "idle_after"]),
    }
    result["fds"] = {
        "idle_before": _median(idle_before),
        "idle_after": _median(idle_after),
        "idle_after_max": max(idle_after) if idle_after else None,
        "start": samples[0].fds,
        "end": samples[-1].fds,
        "max": max(s.fds for s in samples),
        "post_warmup_first_window_median": _median([s.fds for s in first]),
        "post_warmup_last_window_median": _median([s.fds for s in last]),
        "growth_idle": (min(idle_after) - min(idle_before) if idle_after and idle_before else None),
    }
    result["threads"] = {
        "idle_before": _median([s.threads for s in samples if s.phase == "idle_before"]),
        "idle_after": _median([s.threads for s in samples if s.phase == "idle_after"]),
        "max": max(s.threads for s in samples),
    }
    return result


# --- plot and markdown ----------------------------------------------------------------


def plot(results: dict[str, Any], path: Path) -> None:
    """RSS, fds and server gauges against time, with the warm-up boundary marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = results["samples"]
    t = [s["t"] for s in samples]
    mem = results["memory"]
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    ax_rss, ax_fd, ax_g = axes
    ax_rss.plot(t, [s["rss_bytes"] / 2**20 for s in samples], color="tab:blue", lw=1.2, label="RSS")
    rss = mem.get("rss") or {}
    if rss.get("first_window_median_mib") is not None:
        ax_rss.axhline(
            rss["first_window_median_mib"],
            color="tab:green",
            ls=":",
            lw=1,
            label="post-warm-up baseline (median)",
        )
        ax_rss.axhline(
            rss["first_window_median_mib"] * (1 + RSS_GROWTH_LIMIT_PCT / 100),
            color="tab:red",
            ls=":",
            lw=1,
            label=f"+{RSS_GROWTH_LIMIT_PCT:.0f} % limit",
        )
    ax_rss.set_ylabel("RSS (MiB)")
    ax_cache = ax_rss.twinx()
    ax_cache.plot(
        t,
        [s["cache_bytes"] / 2**20 if s.get("cache_bytes") is not None else float("nan") for s in samples],
        color="tab:cyan",
        lw=1,
        label="response cache (right axis)",
    )
    ax_cache.set_ylabel("response cache (MiB)")
    ax_cache.set_ylim(bottom=0)
    ax_fd.plot(t, [s["fds"] for s in samples], color="tab:orange", lw=1.2, label="open fds")
    ax_fd.plot(t, [s["connections"] if s["connections"] is not None else float("nan") for s in samples],
               color="tab:gray", lw=0.8, label="WebSocket connections")  # fmt: skip
    ax_fd.set_ylabel("count")
    ax_g.plot(t, [s["active_streams"] if s["active_streams"] is not None else float("nan") for s in samples],
              color="tab:purple", lw=1, label="chattts_active_streams")  # fmt: skip
    ax_g.plot(t, [s["queue_depth"] if s["queue_depth"] is not None else float("nan") for s in samples],
              color="tab:brown", lw=1, label="chattts_queue_depth")  # fmt: skip
    ax_g.set_ylabel("streams")
    ax_g.set_xlabel("seconds since the load began")
    ax_req = ax_g.twinx()
    ax_req.plot(
        t, [s["requests_done"] for s in samples], color="black", lw=0.8, ls="--", label="requests done"
    )
    ax_req.set_ylabel("requests done")
    for ax in axes:
        ax.axvline(mem["warmup_end_s"], color="tab:red", ls="--", lw=1, label="end of warm-up")
        ax.axvline(mem["load_end_s"], color="tab:green", ls="--", lw=1, label="end of load")
        ax.grid(alpha=0.3)
    rss_lines, rss_labels = ax_rss.get_legend_handles_labels()
    cache_lines, cache_labels = ax_cache.get_legend_handles_labels()
    ax_rss.legend(rss_lines + cache_lines, rss_labels + cache_labels, loc="lower right", fontsize=8)
    ax_fd.legend(loc="lower right", fontsize=8)
    lines, labels = ax_g.get_legend_handles_labels()
    lines2, labels2 = ax_req.get_legend_handles_labels()
    ax_g.legend(lines + lines2, labels + labels2, loc="upper right", fontsize=8)
    acc = results["acceptance"]
    fig.suptitle(
        f"soak: {results['config']['requests']} requests, concurrency {results['config']['concurrency']}, "
        f"engine {results['config']['engine']} — RSS growth {_fmt(rss.get('growth_robust_pct'))} %, "
        f"lost {results['accounting']['lost']}, {'PASS' if acc['pass'] else 'FAIL'}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown(results: dict[str, Any], plot_name: str | None) -> str:
    """A short human-readable report of a soak run."""
    cfg, mem, acc, acct = results["config"], results["memory"], results["acceptance"], results["accounting"]
    machine = results["machine"]
    rss, fds = mem.get("rss") or {}, mem.get("fds") or {}
    lines = [
        f"# Soak benchmark — {cfg['engine']} engine{' (' + cfg['model'] + ')' if cfg.get('model') else ''}",
        "",
        "Command:",
        "",
        f"    {results['command']}",
        "",
        f"Machine: {machine.get('cpu_model')}, {machine.get('cpu_cores')} cores, "
        f"{_fmt(machine.get('memory_gib'), 1)} GiB RAM, load average at start "
        f"{', '.join(f'{x:.1f}' for x in machine.get('loadavg_at_start') or [])}; "
        f"git {str(machine.get('git_commit'))[:12]}.",
        f"Server: `{results['server']['command']}`",
        "",
        f"**Result: {'PASS' if acc['pass'] else 'FAIL'}** — "
        + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in acc["checks"].items()),
        "",
        "| figure | value |",
        "|---|---|",
    ]
    th = mem["threads"]
    cache, end = results["cache"], results["end"]
    rows = [
        ("requests", f"{cfg['requests']} at concurrency {cfg['concurrency']}, seed {cfg['seed']}"),
        (
            "load wall time",
            f"{_fmt(results['load_wall_s'], 1)} s ({_fmt(results['requests_per_s'], 2)} requests/s)",
        ),
        (
            "warm-up",
            f"first {cfg['warmup_frac'] * 100:.0f} % of requests: until t = {_fmt(mem['warmup_end_s'], 1)} s",
        ),
        (
            "RSS post-warm-up first sample → last sample under load",
            f"{_fmt(rss.get('baseline_mib'), 1)} → {_fmt(rss.get('end_mib'), 1)} MiB "
            f"({_fmt(rss.get('growth_pct'))} %)",
        ),
        (
            f"RSS median of the first vs last {_fmt(rss.get('window_s'), 0)} s after warm-up",
            f"{_fmt(rss.get('first_window_median_mib'), 1)} → "
            f"{_fmt(rss.get('last_window_median_mib'), 1)} MiB "
            f"(**{_fmt(rss.get('growth_robust_pct'))} %**, limit {RSS_GROWTH_LIMIT_PCT:.0f} %)",
        ),
        ("RSS trend after warm-up (least squares)", f"{_fmt(rss.get('slope_mib_per_hour'), 1)} MiB/hour"),
        (
            "RSS idle before / max / idle after",
            f"{_fmt(rss.get('idle_before_mib'), 1)} / {_fmt(rss.get('max_mib'), 1)} / "
            f"{_fmt(rss.get('idle_after_mib'), 1)} MiB",
        ),
        (
            "open fds idle before / max under load / idle after",
            f"{_fmt(fds.get('idle_before'))} / {_fmt(fds.get('max'))} / {_fmt(fds.get('idle_after'))} "
            f"(growth {_fmt(fds.get('growth_idle'))})",
        ),
        (
            "threads idle before / max / idle after",
            f"{_fmt(th['idle_before'])} / {_fmt(th['max'])} / {_fmt(th['idle_after'])}",
        ),
        (
            "streams started / done / abandoned and verified freed / **lost**",
            f"{acct['started']} / {acct['done']} / {acct['abandoned_freed']} / **{acct['lost']}**",
        ),
        ("requests with a problem", str(len(results["problems"]))),
        ("cache hits / misses (server counters)", f"{_fmt(cache.get('hits'))} / {_fmt(cache.get('misses'))}"),
        (
            "`chattts_active_streams` back to 0 after the load",
            f"{end['active_streams_zero']} after {_fmt(end['active_zero_after_s'], 1)} s",
        ),
        ("server exit code on SIGTERM", str(end["exit_code"])),
    ]
    lines += [f"| {name} | {value} |" for name, value in rows]
    lines += [
        "",
        "Requests by kind (outcome counts):",
        "",
        "| kind | n | outcomes |",
        "|---|---|---|",
    ]
    for kind, info in sorted(results["kinds"].items()):
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(info["outcomes"].items()))
        lines.append(f"| {kind} | {info['n']} | {outcomes} |")
    lines += [
        "",
        "Error codes the server sent, expected vs received:",
        "",
        "| code | expected | received |",
        "|---|---|---|",
    ]
    errors = results["errors"]
    for code in sorted(set(errors["expected"]) | set(errors["received"])):
        lines.append(f"| {code} | {errors['expected'].get(code, 0)} | {errors['received'].get(code, 0)} |")
    if results["problems"]:
        lines += ["", "Problems (first 20):", ""]
        lines += [f"- request {p['index']} ({p['kind']}): {p['problem']}" for p in results["problems"][:20]]
    if plot_name:
        lines += ["", f"![RSS, open fds and server gauges over the soak]({plot_name})"]
    return "\n".join(lines) + "\n"
