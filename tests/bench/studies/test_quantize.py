"""``python -m bench.studies.quantize`` on the tiny model: int8's fidelity measure holds up.

Its teacher-forced agreement re-samples every code after float32's own past; run on float32
itself, that must give back float32's own codes exactly, or the measure measures nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.runner import run_ok

pytestmark = pytest.mark.model


def test_quantize_bench_reproduces_float32_when_forced_along_its_own_codes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "quantize"
    run_ok(
        "bench.studies.quantize", "--model-dir", str(tiny_model_dir),
        "--configs", "float32,bfloat16+int8", "--tokens", "16", "--cases", "2", "--out", str(out),
        timeout=600,
    )  # fmt: skip
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert results["float32"]["forced_agreement"] == [1.0, 1.0]
    assert results["float32"]["first_divergent_step"] == [None, None]
    int8 = results["bfloat16+int8"]
    assert len(int8["forced_agreement"]) == 2 and all(0 <= a <= 1 for a in int8["forced_agreement"])
    assert "teacher-forced" in out.with_suffix(".md").read_text()
