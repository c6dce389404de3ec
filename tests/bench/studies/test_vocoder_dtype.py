"""``python -m bench.studies.vocoder_dtype`` (tiny model): both dtypes on the same windows, bf16's SNR."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.bench.runner import run_ok

pytestmark = pytest.mark.model


def test_each_case_times_both_dtypes_and_measures_bfloat16_against_float32(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "vocoder"
    run_ok(
        "bench.studies.vocoder_dtype", "--model-dir", str(tiny_model_dir),
        "--rows", "1,2", "--tokens", "12,28", "--rounds", "2", "--hidden-tokens", "60",
        "--out", str(out),
        timeout=600,
    )  # fmt: skip
    cases = json.loads(out.with_suffix(".json").read_text())["cases"]
    assert [(c["rows"], c["tokens"]) for c in cases] == [(1, 12), (1, 28), (2, 12), (2, 28)]
    for case in cases:
        assert all(len(case["ms_all"][name]) == 2 for name in ("float32", "bfloat16"))
        assert case["ms"]["float32"] > 0 and case["ms"]["bfloat16"] > 0
        # bf16 differs (it is not float32 under another name) but stays near it.
        assert 20.0 < case["snr_db_min"] < 80.0 and math.isfinite(case["snr_db_median"])
    assert "| 2 | 28 |" in out.with_suffix(".md").read_text()
