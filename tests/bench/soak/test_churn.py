"""``python -m bench.soak --churn`` for a few seconds against a fake-engine server subprocess.

Checks that the churn soak runs its warm-up and churn with the server's default flags, cycles
every format at 48 kHz through start and cancel, samples RSS and the budget gauge, judges RSS
against the warm baseline plus the server's memory budget plus the margin, and writes its
JSON, report and plot. The RSS verdict of a few seconds says little; the lead's 10-minute run
is the evidence (bench/README.md).
"""

from __future__ import annotations

import json
from pathlib import Path

from server.audio import SUPPORTED_FORMATS
from server.config import Settings
from tests.bench.runner import run_module

MEMORY_KEYS = {
    "baseline_mib", "budget_mib", "margin_mib", "limit_mib", "peak_mib", "peak_over_baseline_mib",
    "first_window_median_mib", "last_window_median_mib", "slope_mib_per_hour", "buffered_max_mib",
    "rss_under_limit",
}  # fmt: skip


def test_churn_soak_cycles_every_format_and_judges_rss_against_the_budget(tmp_path: Path) -> None:
    out = tmp_path / "churn.json"
    flags = (
        "--churn --engine fake --duration-s 3 --warmup-s 2 --window-s 1 --sample-interval-s 0.25 --idle-s 0.3"
    )
    # The timeout is a bound for a loaded machine; the run's length is set by its flags.
    proc = run_module("bench.soak", *flags.split(" "), "--out", str(out), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["schema"] == "chattts-stream-soak-churn/1"
    assert "# Churn soak: PASS" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 0
    # Default server flags: nothing but the engine, the HTTP port and the log level.
    assert results["server"]["flags"] == ["--engine", "fake", "--http-port", "0", "--log-level", "warning"]
    assert results["server"]["memory_budget_bytes"] == Settings().memory_budget_bytes
    churn = results["churn"]
    assert set(churn["cycles_by_format"]) == set(SUPPORTED_FORMATS) and churn["problems"] == []
    memory = results["memory"]
    assert set(memory) == MEMORY_KEYS
    assert memory["limit_mib"] == round(
        memory["baseline_mib"] + memory["budget_mib"] + memory["margin_mib"], 1
    )
    assert memory["peak_mib"] > 0 and memory["buffered_max_mib"] is not None
    phases = {s["phase"] for s in results["samples"]}
    assert {"idle_before", "warmup", "churn", "idle_after"} <= phases
    assert results["acceptance"]["checks"] == {
        "rss_under_budget_plus_baseline_plus_margin": True,
        "every_cycle_as_expected": True,
        "clean_exit_on_sigterm": True,
    }
