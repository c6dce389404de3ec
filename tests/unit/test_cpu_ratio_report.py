"""Part 'ratio' of ``bench.cpu``: the interleaved order and how its rounds become the target.

The c8 ratio target (a server ≥ 0.95× its engine in-process) was decided by two single runs,
on a machine whose run-to-run spread is as large as the gap; part 'ratio' alternates the two
sides and compares their means. These tests pin the order and the arithmetic.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.cpu.realtime import interleaved
from bench.cpu.report import interleaved_pairs, render, targets


def scenario(system: str, throughput: float, round_: int | None, concurrency: int = 8) -> dict[str, Any]:
    return {
        "system": system,
        "mode": "closed",
        "concurrency": concurrency,
        "ratio_round": round_,
        "summary": {"throughput": {"steady_audio_s_per_wall_s": throughput}},
    }


def result_with(ratio_scenarios: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "command": "python -m bench.cpu --parts ratio",
        "settings": {"threads": 2},
        "machine": {"cpu_model": "test", "cpu_cores": 2, "loadavg_at_start": [0.0], "loadavg_now": [0.0]},
        "commits": {"after": "abc"},
        "openmp_env": {},
        "step": None,
        "systems": {},
        "scenarios": [],
        "ratio_scenarios": ratio_scenarios,
        "skipped": [],
    }


def test_rounds_alternate_which_side_goes_first() -> None:
    assert interleaved(3) == [
        (0, "server"),
        (0, "engine"),
        (1, "engine"),
        (1, "server"),
        (2, "server"),
        (2, "engine"),
    ]


def test_the_target_is_the_ratio_of_the_means_of_complete_rounds() -> None:
    result = result_with(
        [
            scenario("after-compiled-w8a8", 3.6, 0),
            scenario("engine-direct-compiled-w8a8", 3.8, 0),
            scenario("engine-direct-compiled-w8a8", 3.4, 1),
            scenario("after-compiled-w8a8", 3.4, 1),
            scenario("after-compiled-w8a8", 9.9, 2),  # round 2 lost its engine run: not counted
        ]
    )
    [(name, pair)] = interleaved_pairs(result).items()
    assert name == "after-compiled-w8a8" and pair["rounds"] == 2 and pair["concurrency"] == 8
    assert pair["server_mean"] == pytest.approx(3.5) and pair["engine_mean"] == pytest.approx(3.6)
    assert abs(pair["ratio"] - 3.5 / 3.6) < 1e-12
    [row] = [r for r in targets(result) if "0.95×" in r[0]]
    assert row[2] is True and "2 interleaved rounds" in row[1]  # 0.972 ≥ 0.95
    md = render(result)
    assert "## Server against its engine in-process, interleaved" in md and "**0.972×**" in md


def test_a_slower_server_misses_and_single_runs_do_not_override_the_rounds() -> None:
    result = result_with(
        [scenario("after-eager", 2.0, 0), scenario("engine-direct", 2.4, 0)]  # 0.83×
    )
    # A single-run pair in the main scenarios that would pass does not decide once rounds exist.
    result["scenarios"] = [
        {**scenario("after-eager", 3.0, None), "streams": [], "summary": single_summary(3.0)},
        {**scenario("engine-direct", 3.0, None), "streams": [], "summary": single_summary(3.0)},
    ]
    rows = [r for r in targets(result) if "0.95×" in r[0]]
    assert len(rows) == 1 and rows[0][2] is False and "interleaved" in rows[0][1]


def single_summary(throughput: float) -> dict[str, Any]:
    none = {"p50": None, "p90": None}
    return {
        "streams": 1,
        "error_streams": 0,
        "throughput": {"steady_audio_s_per_wall_s": throughput, "audio_s_per_cpu_s": None},
        "rtf": none,
        "ttfa_s": none,
    }
