"""``python -m bench.studies.hotpath --no-native`` on the tiny model: the report, without ChatTTS's rows.

Before issue #23 the report step failed with ``KeyError: '8'`` after every run when
ChatTTS's ``infer()`` was left out. "Before" and "after" are this tree twice here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.runner import REPO, run_ok

pytestmark = pytest.mark.model


def test_hotpath_without_native_writes_its_report(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "hotpath"
    run_ok(
        "bench.studies.hotpath", "--model-dir", str(tiny_model_dir), "--before", str(REPO),
        "--no-native", "--concurrency", "4,8", "--slices", "1", "--slice-s", "0.3", "--ttfa", "1",
        "--out", str(out),
        timeout=600,
    )  # fmt: skip
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["raw"]["native"]["closed"] == {"4": [], "8": []}
    for system in ("before", "after"):
        assert set(report["summary"][system]["closed"]) == {"4", "8"}
        assert report["summary"][system]["closed"]["8"]["audio_per_wall"] > 0
    md = out.with_suffix(".md").read_text()
    assert "## Closed loop, 8 streams" in md and "| native |" not in md
