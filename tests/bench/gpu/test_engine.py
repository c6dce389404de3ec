"""``python -m bench.gpu.engine`` on the CPU with the tiny model: the GPU profile cannot rot unseen."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench.runner import run_ok


def test_gpu_engine_reports_loops_split_and_profile(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "gpu_engine"
    run_ok(
        "bench.gpu.engine", "--model-dir", tiny_model_dir, "--device", "cpu", "--max-batch", "4",
        "--levels", "1,4", "--seconds", "1", "--settle-s", "0.3", "--profile-blocks", "1", "--low", "8",
        "--span", "4", "--block-schedule", "4,6,8,10,12", "--out", out,
    )  # fmt: skip
    report = json.loads(out.with_name("gpu_engine.json").read_text())
    assert set(report["closed"]) == {"1", "4"}
    assert report["block_schedule"] == "4,6,8,10,12"  # the engine ran the schedule asked for
    for loop in report["closed"].values():  # jobs of 8-11 tokens: several end in a timed second
        assert loop["audio_s"] > 0 and loop["jobs_started"] >= 1
        assert loop["audio_s_per_wall_s"] == loop["audio_s"] / loop["wall_s"]
        # no block is longer than the schedule's longest, and each runs at least one token step
        assert 1 <= loop["tokens_per_block"] <= 12
        assert loop["tokens_per_block"] == loop["token_steps"] / loop["blocks"]
    for batch in ("1", "4"):
        parts = report["blocks"][batch]
        # the parts and the rest add up to the block's time per token step
        explained = sum(v for k, v in parts.items() if k != "total")
        assert abs(explained - parts["total"]) < 0.01
        assert parts["llama"] > 0
        assert report["block_tokens"][batch] == 12  # past the ramp: the schedule's last block
    assert "Self CPU time total" in report["profile"]["host"]
    assert "| 4 |" in out.with_name("gpu_engine.md").read_text()
