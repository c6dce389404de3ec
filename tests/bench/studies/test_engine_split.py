"""``python -m bench.studies.engine_split`` on the tiny model: the closed loop's time, split by part."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.runner import run_ok

pytestmark = pytest.mark.model


def test_engine_split_accounts_for_the_closed_loops_time(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "split"
    run_ok(
        "bench.studies.engine_split", "--model-dir", str(tiny_model_dir),
        "--concurrency", "1,4", "--duration", "1.5", "--warm-s", "0.5", "--max-audio-s", "2",
        "--threads", "2", "--out", str(out),
        timeout=600,
    )  # fmt: skip
    report = json.loads(out.with_suffix(".json").read_text())
    assert [s["concurrency"] for s in report["scenarios"]] == [1, 4]
    for s in report["scenarios"]:
        parts = s["parts_s"]
        assert set(parts) == {"step", "decode", "prefill", "other"}
        assert parts["step"] > 0 and parts["decode"] > 0 and parts["prefill"] > 0
        assert sum(parts.values()) == pytest.approx(s["wall_s"], rel=1e-6)  # every second is in one part
        assert s["audio_s"] > 0 and s["streams"] > 0
        batches = {t["batch"] for t in s["steps"]}
        assert max(batches) == (1 if s["concurrency"] == 1 else 4)
        assert sum(t["count"] * t["mean_ms"] for t in s["steps"]) / 1000 == pytest.approx(parts["step"])
    md = out.with_suffix(".md").read_text()
    assert "## Token steps at 4 streams, by shape" in md and "python -m bench.studies.engine_split" in md
