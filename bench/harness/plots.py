"""PNG plots of a run: latency CDFs, and latency and throughput against concurrency (matplotlib)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _readable_log_axis(axis: Any) -> None:
    """Label a log axis at 1, 2 and 5 of every decade, as plain numbers (``0.5``, ``2``, ``20``).

    matplotlib's default labels only the decades (``10^0``, ``10^1``) and hides the minor
    labels, so a latency spread over less than a decade showed one label or none at all.
    """
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def _suptitle(fig: Any, results: dict[str, Any], width_in: float) -> None:
    """The run's caption, wrapped to the figure's width so that no line is clipped at its edges."""
    chars = max(40, int(width_in * 11))  # 9-point text: fewer than 12 characters to the inch
    fig.suptitle(textwrap.fill(_caption(results), chars), fontsize=9)


def _scenario_name(s: dict[str, Any]) -> str:
    fmt = f" {s['format']}" if s["format"] not in ("f32", "pcm16") else ""
    return f"{s['label']}{fmt}"


def plot_cdfs(results: dict[str, Any], path: Path) -> None:
    """Write :func:`cdf_figure` to ``path``."""
    plt = _pyplot()
    fig = cdf_figure(results)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cdf_figure(results: dict[str, Any]) -> Any:
    """One column per system, rows: time to first audio, to first non-silent sample, RTF."""
    plt = _pyplot()
    scenarios = results["scenarios"]
    systems = list(dict.fromkeys(s["system"] for s in scenarios))
    rows = (
        ("ttfa_s", "time to first audio (s)"),
        ("ttfs_s", "time to first non-silent sample (s)"),
        ("rtf", "RTF"),
    )
    width = 4.2 * max(1, len(systems))
    # constrained layout makes room for the (wrapped) caption above the column titles.
    fig, axes = plt.subplots(
        len(rows), max(1, len(systems)), figsize=(width, 9), squeeze=False, layout="constrained"
    )
    for col, system in enumerate(systems):
        for row, (key, title) in enumerate(rows):
            ax = axes[row][col]
            for s in (s for s in scenarios if s["system"] == system):
                values = np.sort([m[key] for m in s["streams"] if m[key] is not None])
                if values.size:
                    ax.step(
                        values,
                        np.arange(1, values.size + 1) / values.size,
                        where="post",
                        label=_scenario_name(s),
                    )
            ax.set_xlabel(title)
            ax.set_ylabel("fraction of streams")
            ax.grid(alpha=0.3)
            ax.set_xscale("log")
            _readable_log_axis(ax.xaxis)
            if row == 0:
                ax.set_title(system)
                ax.legend(fontsize=7)
    _suptitle(fig, results, width)
    return fig


def plot_concurrency(results: dict[str, Any], path: Path) -> None:
    """Closed-loop scenarios: TTFA p50/p90 and steady throughput against concurrency, per system."""
    plt = _pyplot()
    closed = [s for s in results["scenarios"] if s["mode"] == "closed"]
    fig, (ax_lat, ax_tp) = plt.subplots(1, 2, figsize=(11, 4.5), layout="constrained")
    for system, fmt in dict.fromkeys((s["system"], s["format"]) for s in closed):
        points = sorted(
            (s for s in closed if s["system"] == system and s["format"] == fmt),
            key=lambda s: s["concurrency"],
        )
        xs = [s["concurrency"] for s in points]
        name = system if fmt in ("f32", "pcm16") else f"{system} {fmt}"
        p50 = [s["summary"]["ttfa_s"]["p50"] for s in points]
        p90 = [s["summary"]["ttfa_s"]["p90"] for s in points]
        line = ax_lat.plot(xs, p50, marker="o", label=f"{name} p50")[0]
        ax_lat.plot(xs, p90, marker="x", linestyle="--", color=line.get_color(), label=f"{name} p90")
        tp = [s["summary"]["throughput"]["steady_audio_s_per_wall_s"] for s in points]
        ax_tp.plot(xs, tp, marker="o", color=line.get_color(), label=name)
    ax_lat.set_xlabel("concurrent streams (closed loop)")
    ax_lat.set_ylabel("time to first audio (s)")
    ax_lat.set_yscale("log")
    _readable_log_axis(ax_lat.yaxis)
    ax_lat.grid(alpha=0.3, which="both")
    ax_lat.legend(fontsize=7)
    ax_tp.set_xlabel("concurrent streams (closed loop)")
    ax_tp.set_ylabel("audio seconds per wall second")
    ax_tp.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax_tp.grid(alpha=0.3)
    ax_tp.legend(fontsize=7)
    _suptitle(fig, results, 11)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _caption(results: dict[str, Any]) -> str:
    machine = results["machine"]
    gpus = ", ".join(machine["gpus"]) or "no GPU"
    return f"{machine['cpu_model']} ({machine['cpu_cores']} cores), {gpus}; {results['title']}"


def write_plots(results: dict[str, Any], prefix: Path) -> list[str]:
    """Write ``PREFIX-cdf.png`` and ``PREFIX-concurrency.png``; returns their paths."""
    cdf = prefix.with_name(prefix.name + "-cdf.png")
    conc = prefix.with_name(prefix.name + "-concurrency.png")
    plot_cdfs(results, cdf)
    plot_concurrency(results, conc)
    return [str(cdf), str(conc)]
