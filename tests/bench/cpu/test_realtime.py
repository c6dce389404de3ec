"""``python -m bench.cpu`` on the tiny model, small: issue #23's comparison command still runs.

The committed results (``bench/results/cpu/xeon-2core.md``, ``cpu/epyc-2core.md``) came from the
full-size model; this checks that the command, its step child and its report keep working (every
step row, the split, the profile, one server scenario with ``hello.compute``, and part 'ratio' in
its interleaved order).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.engine.chattts.step import w8a8_vnni
from tests.bench.runner import run_ok

pytestmark = pytest.mark.model


def test_cpu_realtime_writes_step_rows_and_a_server_scenario(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cpu"
    run_ok(
        "bench.cpu", "--model-dir", str(tiny_model_dir),
        "--parts", "step,servers,ratio", "--systems", "after-eager", "--concurrency", "1", "--duration", "1",
        "--ratio-systems", "after-eager", "--ratio-rounds", "2", "--ratio-concurrency", "1",
        "--max-audio-s", "0.5", "--text-sizes", "short", "--step-rounds", "1", "--step-batches", "1,2",
        "--step-iterations", "1", "--out", str(out),
        timeout=600,
    )  # fmt: skip
    result = json.loads(out.with_name("cpu.json").read_text())
    rows = result["step"]["rows"]
    for name in (
        "floor-plain",
        "floor-int8-fbgemm",  # the w8a8 step's floor (FBGEMM: products-w8a8 below needs it too)
        *(["floor-int8-vnni"] if w8a8_vnni.available() else []),  # and the VNNI kernel's
        "products-dense",
        "products-onednn-bf16",
        "products-int8",
        "products-w8a8",
        "transformers",
    ):
        assert {f"{name}@1", f"{name}@2"} <= set(rows)
        assert rows[f"{name}@1"]["best_cpu_ms"] > 0
    assert result["step"]["slot_positions"] == result["step"]["length"] - 1  # live rows, as transformers'
    for form in ("dense", "onednn-bf16", "int8", "w8a8"):
        split = result["step"]["splits"][f"step-{form}@2"]
        assert split["projections"] > 0 and split["total"] >= split["projections"]
        assert result["step"]["profiles"][f"step-{form}@1"]
    server, ratio_server = result["systems"]["after-eager"]  # 'servers' started one, 'ratio' another
    assert server["hello"]["compute"]["quantize"] == "none"
    assert ratio_server["hello"]["compute"]["quantize"] == "none"
    # Part 'ratio': server then engine, then engine then server, each tagged with its round.
    sides = [(s["ratio_round"], s["system"]) for s in result["ratio_scenarios"]]
    assert sides == [(0, "after-eager"), (0, "engine-direct"), (1, "engine-direct"), (1, "after-eager")]
    assert all(s["concurrency"] == 1 and s["summary"]["streams"] >= 1 for s in result["ratio_scenarios"])
    [scenario] = [s for s in result["scenarios"] if s["system"] == "after-eager"]
    assert scenario["concurrency"] == 1 and scenario["summary"]["streams"] >= 1
    figures = scenario["engine_thread"]  # the server's inference thread, from its /metrics
    assert figures["engine_steps"] > 0 and 0 < figures["engine_busy"] <= 1.2
    assert figures["tokens_per_block"] > 0 and figures["rows_per_step"] == 1  # one stream at a time
    assert figures["step_ms_per_token"] > 0
    md = out.with_name("cpu.md").read_text()
    assert "## Targets" in md and "| after-eager c1 |" in md
    assert "step ms per token step" in md
    assert "## Server against its engine in-process, interleaved" in md
    assert "after-eager: server ≥ 0.95× the engine in-process at c1" in md and "2 interleaved rounds" in md
