"""``bench.cpu.report``'s issue #46 margin: the batch-1 compiled w8a8 step ÷ the int8 floor, one run."""

from __future__ import annotations

from typing import Any

from bench.cpu.report import targets
from bench.cpu.step_report import INT8_FLOOR_RATIO


def _step(**best_ms: float) -> dict[str, Any]:
    rows = {f"{name}@1": {"ms": [ms], "best_ms": ms, "best_cpu_ms": ms} for name, ms in best_ms.items()}
    return {"rows": rows, "batches": [1]}


def _margin(step: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    return [row for row in targets({"step": step, "scenarios": []}) if "int8 floor" in row[0]]


def test_the_step_over_its_int8_floor_is_a_target_of_the_run() -> None:
    [(what, numbers, met)] = _margin(_step(**{"step-compiled-w8a8": 12.0, "floor-int8": 8.0}))
    assert what == f"batch-1 compiled w8a8 step ≤ {INT8_FLOOR_RATIO:g}× the int8 floor"
    assert numbers.startswith("12.00 / 8.00 ms = 1.50×") and met is True
    [(_, numbers, met)] = _margin(_step(**{"step-compiled-w8a8": 13.0, "floor-int8": 8.0}))
    assert "1.62×" in numbers and met is False


def test_no_margin_without_both_rows() -> None:
    """A run without ``--compiled-step w8a8`` (or without FBGEMM) reports no ratio rather than a wrong one."""
    assert _margin(_step(**{"floor-int8": 8.0})) == []
    assert _margin(_step(**{"step-compiled-w8a8": 12.0})) == []


def test_the_margin_is_the_defaults_step_where_the_run_has_it() -> None:
    """The default builds the step ahead of time: its row, not the lazily compiled one, meets the floor."""
    both = _step(**{"step-compiled-w8a8": 9.0, "step-compiled-w8a8-ahead": 13.0, "floor-int8": 8.0})
    [(_, numbers, met)] = _margin(both)
    assert numbers.startswith("13.00 / 8.00 ms") and met is False


def test_the_int8_floor_is_the_faster_of_its_kernels() -> None:
    """FBGEMM and the VNNI kernel each read the int8 weights once; the floor is the faster (as bf16's is)."""
    both = _step(**{"step-compiled-w8a8-ahead": 9.0, "floor-int8-fbgemm": 8.0, "floor-int8-vnni": 6.0})
    [(_, numbers, met)] = _margin(both)
    assert numbers.startswith("9.00 / 6.00 ms = 1.50×") and met is True
    [(_, numbers, _)] = _margin(_step(**{"step-compiled-w8a8-ahead": 9.0, "floor-int8-fbgemm": 6.0}))
    assert numbers.startswith("9.00 / 6.00 ms")  # a CPU without VNNI: FBGEMM's alone


def test_the_floor_timed_beside_the_step_is_its_floor() -> None:
    """A floor from the step rows' process, minutes earlier, would add the VM's drift to the ratio.

    bench.cpu.compiled times the floor beside the compiled step in every round of its process; that
    pair decides, and each round's ratio is shown.
    """
    step = _step(**{"step-compiled-w8a8-ahead": 9.0, "floor-int8-vnni": 4.0})
    step["rows"]["step-compiled-w8a8-ahead@1"]["ms"] = [9.5, 9.0]
    step["rows"]["step-compiled-w8a8-ahead:floor-int8@1"] = {"ms": [6.0, 6.5], "best_ms": 6.0}
    [(_, numbers, met)] = _margin(step)
    assert numbers.startswith("9.00 / 6.00 ms = 1.50×") and met is True
    assert "timed beside it" in numbers and "each round 1.58, 1.38" in numbers
