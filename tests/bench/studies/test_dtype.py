"""``python -m bench.studies.dtype`` on the tiny model: the script that chose ``--dtype auto`` still runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.runner import run_ok

pytestmark = pytest.mark.model


def test_dtype_bench_writes_paired_results(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "dtype"
    run_ok(
        "bench.studies.dtype", "--model-dir", str(tiny_model_dir), "--batches", "1,2",
        "--tokens", "8", "--rounds", "2", "--fidelity-tokens", "12", "--fidelity-cases", "2",
        "--out", str(out),
        timeout=600,
    )  # fmt: skip
    report = json.loads(out.with_suffix(".json").read_text())
    for dtype in ("float32", "bfloat16"):
        for batch in ("1", "2"):
            runs = report["throughput"][dtype][batch]["runs"]
            assert len(runs) == 2 and all(r["audio_s"] == int(batch) * 8 * 512 / 24_000 for r in runs)
    steps = report["fidelity"]["bfloat16"]["first_divergent_step"]
    assert len(steps) == 2 and all(s is None or 0 <= s <= 12 for s in steps)
    assert "median ×" in out.with_suffix(".md").read_text()
