"""The chaos soak's judgement and report (:mod:`bench.chaos`): the five checks, tables, markdown."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

#: Attack windows' normal p99 time to first audio may be at most this many times the quiet windows'.
TTFA_RATIO_LIMIT = 2.0
MIB = 1024 * 1024


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0–100) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _ttfa(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    times = [r["ttfa_s"] for r in records if r["ok"] and r["ttfa_s"] is not None]
    return {
        "streams": len(records),
        "lost": sum(1 for r in records if not r["ok"]),
        "p50_s": percentile(times, 50),
        "p99_s": percentile(times, 99),
        "max_s": max(times) if times else None,
    }


def judge(
    records: Sequence[dict[str, Any]],
    samples: Sequence[dict[str, Any]],
    *,
    budget_mib: int,
    margin_mib: int,
    drain: dict[str, Any],
) -> dict[str, Any]:
    """The figures and the five checks of issue #25's chaos soak."""
    quiet = [r for r in records if r["phase"] == "quiet"]
    attacked = [r for r in records if r["phase"] not in ("quiet", "reference")]
    by_attack = {
        phase: _ttfa([r for r in attacked if r["phase"] == phase])
        for phase in sorted({r["phase"] for r in attacked})
    }
    ttfa = {"quiet": _ttfa(quiet), "attack": _ttfa(attacked), "by_attack": by_attack}
    p99_quiet, p99_attack = ttfa["quiet"]["p99_s"], ttfa["attack"]["p99_s"]
    ratio = p99_attack / p99_quiet if p99_quiet and p99_attack is not None else None

    lost = [r for r in records if not r["ok"]]
    corrupted = [r for r in records if r["corrupted"]]
    load = [s for s in samples if s["phase"] == "quiet" or s["phase"].startswith("attack:")]
    rss_max = max((s["rss_bytes"] for s in load), default=0) / MIB
    limit_mib = budget_mib + margin_mib
    idle_before = [s["fds"] for s in samples if s["phase"] == "idle_before"]
    idle_after = [s["fds"] for s in samples if s["phase"] == "idle_after"]
    fds = {
        "idle_before": min(idle_before) if idle_before else None,
        "idle_after": min(idle_after) if idle_after else None,
        "max": max((s["fds"] for s in samples), default=None),
    }
    rss_by_phase: dict[str, float] = {}
    for s in samples:
        rss_by_phase[s["phase"]] = max(rss_by_phase.get(s["phase"], 0.0), s["rss_bytes"] / MIB)
    checks = {
        "zero_lost_or_corrupted_normal_streams": bool(records) and not lost,
        "normal_ttfa_p99_within_2x_of_quiet": ratio is not None and ratio <= TTFA_RATIO_LIMIT,
        "rss_under_budget_plus_margin": bool(load) and rss_max <= limit_mib,
        "fds_flat": fds["idle_before"] is not None
        and fds["idle_after"] is not None
        and fds["idle_after"] <= fds["idle_before"],
        "exit_0_within_drain_timeout_plus_5s": drain.get("exit_code") == 0
        and drain.get("exit_s", math.inf) <= drain.get("limit_s", 0),
    }
    return {
        "normal": {
            "streams": len(records),
            "lost": len(lost),
            "corrupted": len(corrupted),
            "problems": [{k: r[k] for k in ("worker", "phase", "problem")} for r in lost[:20]],
        },
        "ttfa": {**ttfa, "ratio_p99": ratio, "ratio_limit": TTFA_RATIO_LIMIT},
        "memory": {
            "rss_max_mib": rss_max,
            "rss_limit_mib": limit_mib,
            "budget_mib": budget_mib,
            "margin_mib": margin_mib,
            "rss_max_by_phase_mib": rss_by_phase,
        },
        "fds": fds,
        "acceptance": {"pass": all(checks.values()), "checks": checks},
    }


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:.0f}"


def markdown(results: dict[str, Any]) -> str:
    """The report: verdict, checks, time to first audio by phase, attacks, memory, drain."""
    checks = results["acceptance"]["checks"]
    ttfa, memory, fds, drain = results["ttfa"], results["memory"], results["fds"], results["drain"]
    machine = results["machine"]
    lines = [
        "# Chaos soak (issue #25)",
        "",
        f"`{results['command']}`",
        "",
        f"{results['created']}, {machine.get('cpu_model')} × {machine.get('cpu_cores')}, "
        f"load average at start {machine.get('loadavg_at_start')}, commit {machine.get('git_commit')}.",
        "",
        f"**{'PASS' if results['acceptance']['pass'] else 'FAIL'}**",
        "",
        "| check | value | pass |",
        "|---|---|---|",
        _check(
            "zero lost or corrupted normal streams",
            f"{results['normal']['streams']} streams, {results['normal']['lost']} lost, "
            f"{results['normal']['corrupted']} corrupted",
            checks["zero_lost_or_corrupted_normal_streams"],
        ),
        _check(
            f"normal TTFA p99, attacks / quiet (≤ {ttfa['ratio_limit']:g}×)",
            f"{_ms(ttfa['attack']['p99_s'])} ms / {_ms(ttfa['quiet']['p99_s'])} ms "
            f"= {_ratio(ttfa['ratio_p99'])}",
            checks["normal_ttfa_p99_within_2x_of_quiet"],
        ),
        _check(
            f"RSS max under load ≤ budget {memory['budget_mib']} MiB + margin {memory['margin_mib']} MiB",
            f"{memory['rss_max_mib']:.0f} MiB ≤ {memory['rss_limit_mib']} MiB",
            checks["rss_under_budget_plus_margin"],
        ),
        _check(
            "fds flat (idle after ≤ idle before)",
            f"{fds['idle_after']} ≤ {fds['idle_before']} (max {fds['max']})",
            checks["fds_flat"],
        ),
        _check(
            "exit 0 on SIGTERM within drain timeout + 5 s",
            f"exit {drain.get('exit_code')} after {drain.get('exit_s', float('nan')):.1f} s "
            f"(limit {drain.get('limit_s', float('nan')):.0f} s)",
            checks["exit_0_within_drain_timeout_plus_5s"],
        ),
        "",
        "## Normal clients' time to first audio, by window",
        "",
        "| window | streams | lost | p50 ms | p99 ms | max ms |",
        "|---|---|---|---|---|---|",
    ]
    rows = [("quiet", ttfa["quiet"]), ("all attacks", ttfa["attack"]), *ttfa["by_attack"].items()]
    for name, row in rows:
        times = " | ".join(_ms(row[k]) for k in ("p50_s", "p99_s", "max_s"))
        lines.append(f"| {name} | {row['streams']} | {row['lost']} | {times} |")
    lines += [
        "",
        "## Attacks: probes answered as the issue expects",
        "",
        "| attack | windows | probes | as expected | what the probes got (most frequent) |",
        "|---|---|---|---|---|",
    ]
    for name, entry in results["attacks"].items():
        notes = sorted(entry["notes"].items(), key=lambda kv: -kv[1])[:4]
        told = "; ".join(f"{note} ×{n}" for note, n in notes)
        lines.append(f"| {name} | {entry['windows']} | {entry['probes']} | {entry['expected']} | {told} |")
    defended = sum(1 for e in results["attacks"].values() if e["probes"] and e["expected"] == e["probes"])
    lines += [
        "",
        f"Attacks whose every probe got the expected answer: {defended} of {len(results['attacks'])} "
        "(not a pass/fail check: the checks above are the issue's acceptance).",
        "",
        "## Memory (RSS max by phase, MiB)",
        "",
        "| phase | RSS max MiB |",
        "|---|---|",
        *(f"| {phase} | {mib:.0f} |" for phase, mib in sorted(memory["rss_max_by_phase_mib"].items())),
        "",
    ]
    if results["normal"]["problems"]:
        lines += ["## Lost normal streams (first 20)", "", "| worker | window | problem |", "|---|---|---|"]
        lines += [f"| {p['worker']} | {p['phase']} | {p['problem']} |" for p in results["normal"]["problems"]]
        lines.append("")
    return "\n".join(lines)


def _check(name: str, value: str, ok: bool) -> str:
    return f"| {name} | {value} | {_yes(ok)} |"


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"
