"""``python -m bench.studies.attention`` at small shapes: dense attention, the C++ operator, the bare read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.runner import run_ok


def test_attention_bench_times_both_parts_at_every_shape(tmp_path: Path) -> None:
    out = tmp_path / "attention"
    run_ok(
        "bench.studies.attention", "--shapes", "1x16,3x40", "--layers", "2", "--heads", "2",
        "--head-dim", "8",
        "--slots", "4", "--max-len", "64", "--rounds", "2", "--iterations", "3", "--threads", "2",
        "--out", str(out),
        timeout=600,
    )  # fmt: skip
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["kv_dtype"] == "bfloat16"  # the compiled step's slots
    assert [(r["batch"], r["length"]) for r in report["rows"]] == [(1, 16), (3, 40)]
    for row in report["rows"]:
        # keys and values, every layer, head and position of the batch's rows, 2 bytes each
        assert row["bytes"] == 2 * 2 * row["batch"] * 2 * row["length"] * 8 * 2
        for part in ("attention", "decode_attention", "read"):
            assert len(row[part]["rounds_ms"]) == 2
            assert row[part]["ms"] == min(row[part]["rounds_ms"]) > 0
            assert row[part]["gb_s"] == pytest.approx(row["bytes"] / row[part]["ms"] / 1e6)
        assert row["attention_over_read"] == pytest.approx(row["attention"]["ms"] / row["read"]["ms"])
        assert row["operator_over_attention"] == pytest.approx(
            row["decode_attention"]["ms"] / row["attention"]["ms"]
        )
    # rows of every age: 3 rows over 40 positions attend 40, 25 and 10 of them
    assert report["rows"][1]["reached_bytes"] == report["rows"][1]["bytes"] * (40 + 25 + 10) // 120
    assert report["rows"][0]["reached_bytes"] == report["rows"][0]["bytes"]
    md = out.with_suffix(".md").read_text()
    assert "| 3 | 40 |" in md and "python -m bench.studies.attention" in md
