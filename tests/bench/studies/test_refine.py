"""``python -m bench.studies.refine`` on the tiny model: the script behind its committed result still runs.

(``bench/results/studies/refine-epyc-2core.md``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.runner import run_ok

pytestmark = pytest.mark.model


def test_refine_bench_writes_paired_results(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "refine"
    run_ok(
        "bench.studies.refine", "--model-dir", str(tiny_model_dir), "--dtype", "float32",
        "--refine-tokens", "8,12", "--batches", "1,2", "--rounds", "2", "--out", str(out),
        timeout=600,
    )  # fmt: skip
    report = json.loads(out.with_suffix(".json").read_text())
    for batch in ("1", "2"):
        runs = report["runs"][batch]
        assert [len(r["ttfa_s"]) for r in runs["0"]] == [int(batch)] * 2
        assert all(r["refine_tokens"] == [] for r in runs["0"])  # off: the refiner is never asked
        for cap in (8, 12):
            # Random weights never end a refinement early: every row runs to the cap.
            assert all(r["refine_tokens"] == [cap] * int(batch) for r in runs[str(cap)])
            assert len(report["summary"][batch][str(cap)]["added_s_per_round"]) == 2
    assert "ms per refinement token" in out.with_suffix(".md").read_text()
