"""The soak's verdict: every request's outcome tallied, every started stream accounted for, and the checks.

:func:`summarize` is the accounting of the JSON file; :func:`acceptance_checks` judges it with the
memory analysis of :mod:`bench.soak.report` and the server's end (active streams, SIGTERM).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from bench.soak.outcome import Outcome
from bench.soak.report import RSS_GROWTH_LIMIT_PCT


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    """Accounting, kinds, error codes and problems of all requests."""
    started = sum(o.started for o in outcomes)
    done = sum(o.done for o in outcomes)
    freed = sum(o.abandoned_freed for o in outcomes)
    lost = sum(o.lost for o in outcomes)
    kinds: dict[str, dict[str, Any]] = {}
    for o in outcomes:
        name = f"bad:{o.sub}" if o.kind == "bad" else o.kind
        entry = kinds.setdefault(name, {"n": 0, "outcomes": Counter()})
        entry["n"] += 1
        entry["outcomes"][o.outcome] += 1
    expected: Counter[str] = Counter()
    received: Counter[str] = Counter()
    for o in outcomes:
        expected.update(o.expected_errors)
        received.update(o.received_errors)
    problems = [
        {"index": o.index, "kind": f"bad:{o.sub}" if o.kind == "bad" else o.kind, "problem": o.problem}
        for o in sorted(outcomes, key=lambda o: o.index)
        if o.problem
    ]
    return {
        "accounting": {
            "requests": len(outcomes),
            "requests_ok": len(outcomes) - len(problems),
            "started": started,
            "done": done,
            "abandoned_freed": freed,
            "lost": lost,
            "balanced": started == done + freed + lost,
        },
        "kinds": {k: {"n": v["n"], "outcomes": dict(v["outcomes"])} for k, v in kinds.items()},
        "errors": {"expected": dict(expected), "received": dict(received)},
        "problems": problems,
    }


def acceptance_checks(
    memory: dict[str, Any], summary: dict[str, Any], active_zero: bool, exit_code: int | None
) -> dict[str, bool]:
    """Issue #9's acceptance: flat RSS and fds, no lost stream, every request as expected, a clean end."""
    rss = memory.get("rss") or {}
    fds = memory.get("fds") or {}
    growth = rss.get("growth_robust_pct")
    return {
        "rss_growth_under_5pct": growth is not None and growth < RSS_GROWTH_LIMIT_PCT,
        "no_fd_growth": fds.get("growth_idle") is not None and fds["growth_idle"] <= 0,
        "zero_lost_streams": summary["accounting"]["lost"] == 0 and summary["accounting"]["balanced"],
        "every_request_as_expected": not summary["problems"],
        "active_streams_back_to_0": active_zero,
        "clean_exit_on_sigterm": exit_code == 0,
    }
