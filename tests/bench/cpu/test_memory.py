"""``python -m bench.cpu.memory`` and ``bench.studies.placement`` on the tiny model: the scripts behind
bench/results/cpu/memory-*.md and studies/placement-*.md still run (issue #23)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.runner import run_ok

pytestmark = [pytest.mark.model, pytest.mark.timeout(900)]


def test_cpu_memory_bench_measures_a_server_and_the_engines_rows(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "memory"
    run_ok(
        "bench.cpu.memory", "--model-dir", str(tiny_model_dir), "--streams", "2", "--duration", "2",
        "--grace-s", "5", "--rows", "2", "--row-tokens", "40", "--out", str(out),
        timeout=840,
    )  # fmt: skip
    report = json.loads(out.with_suffix(".json").read_text())
    [server] = report["servers"]
    assert server["rss_at_rest"] > 0 and server["streams"] >= 2 and server["errors"] == 0
    assert server["kv_cache_bytes"] > 0 and server["samples"]
    rows = report["engine_rows"]
    held = [b["positions"] for b in rows["blocks"]]
    assert max(held) >= 2 * 40 and held[-1] == 0  # the rows grew, then ended
    assert rows["kv_after"] < max(b["kv_resident"] for b in rows["blocks"])
    assert "RSS after warm-up" in out.with_suffix(".md").read_text()


def test_placement_bench_interleaves_a_server_and_the_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "placement"
    run_ok(
        "bench.studies.placement", "--model-dir", str(tiny_model_dir),
        "--systems", "server t1 passive,engine t2",
        "--rounds", "2", "--seconds", "2", "--concurrency", "2", "--out", str(out),
        timeout=840,
    )  # fmt: skip
    report = json.loads(out.with_suffix(".json").read_text())
    assert len(report["rounds"]) == 2
    assert [r["order"] for r in report["rounds"]] == [
        ["server t1 passive", "engine t2"],
        ["engine t2", "server t1 passive"],
    ]
    for r in report["rounds"]:
        for result in r["results"]["c2"].values():
            assert result["streams"] >= 2 and not result["errors"] and result["audio_s_per_wall_s"] > 0
    table = out.with_suffix(".md").read_text()
    assert "| c2 | server t1 passive |" in table and "| c2 | engine t2 |" in table
