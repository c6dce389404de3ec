"""``python -m bench.gpu --device cpu --smoke``: every stage of the GPU check, on the CPU with the tiny model.

The command a GPU machine runs (model tests on the device, token-step timing, a server
with time-to-first-audio scenarios, the zero-underrun search, the report) must not rot
where no GPU is: CI runs all of it here, small.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.runner import run_ok

pytest.importorskip("ChatTTS")

pytestmark = pytest.mark.model  # the tiny ChatTTS model, on the CPU


def test_gpu_check_smoke_runs_every_stage(tmp_path: Path) -> None:
    prefix = tmp_path / "gpu-smoke"
    argv = ["--device", "cpu", "--smoke", "--budget-s", "400"]
    argv += ["--cache-dir", str(tmp_path / "cache"), "--out", str(prefix)]
    proc = run_ok("bench.gpu", *argv, timeout=600)
    results = json.loads(prefix.with_name("gpu-smoke.json").read_text())
    stages = results["stages"]
    assert {name: s["status"] for name, s in stages.items()} == dict.fromkeys(
        ("tests", "step", "engine", "ttfa", "search"), "ok"
    )
    assert stages["tests"]["counts"] == {"passed": 1}
    step = stages["step"]
    assert [r["batch"] for r in step["rows"]] == [1, 2, 4]
    assert all(r["eager_ms"] > 0 and "graphs_ms" not in r for r in step["rows"])  # no CUDA: eager only
    assert step["extra"]["token_step"] == "eager"
    scenarios = stages["ttfa"]["scenarios"]
    assert [s["concurrency"] for s in scenarios] == [1, 2]
    assert all(
        s["streams"] >= s["concurrency"] and s["ttfa_p50_s"] > 0 and not s["errors"] for s in scenarios
    )
    for s in scenarios:  # the inference thread's figures, from the server's /metrics around each
        assert s["engine_steps"] > 0 and 0 < s["engine_busy"] <= 1.2  # a share of the wall time
        assert 0 < s["tokens_per_block"] <= 32 and 1 <= s["rows_per_step"] <= 4  # --max-batch 4
    [(schedule, engine)] = stages["engine"]["runs"].items()  # the engine alone, its default schedule
    assert engine["default"] and schedule == "8,16,20,20,24,24,28,32"
    assert set(engine["closed"]) == {"1", "2"}  # the server scenarios' levels
    assert all(loop["audio_s"] > 0 and loop["tokens_per_block"] >= 1 for loop in engine["closed"].values())
    search = stages["search"]
    assert 1 <= search["largest_zero_underrun_concurrency"] <= 4
    assert search["probes"]
    assert results["versions"]["torch"] and results["versions"]["device"] == "cpu"
    assert "zero_underrun_streams" in results["verdicts"]
    report = prefix.with_name("gpu-smoke.md").read_text()
    assert "## Token step" in report and "## Server scenarios" in report and "| search | ok |" in report
    assert "| streams | engine busy | tokens per block | rows per step |" in report
    assert "## The engine alone against the server" in report
    assert "| 8,16,20,20,24,24,28,32 | 2 |" in report and "×" in report.split("against the server")[1]
    assert "[bench.gpu] stage search: ok" in proc.stdout


def test_device_tests_come_first_and_every_model_test_runs_once() -> None:
    from bench.gpu.model_tests import DEVICE_TESTS_FIRST, model_tests_by_priority

    files = model_tests_by_priority()
    names = [path.name for path in files]
    assert names[: len(DEVICE_TESTS_FIRST)] == list(DEVICE_TESTS_FIRST)  # each still exists
    on_disk = sorted(p.name for p in (Path(__file__).parents[2] / "model").glob("test_*.py"))
    assert sorted(names) == on_disk and len(set(names)) == len(names)
