"""``python -m bench.studies.omp_spin`` (tiny model): each setting reaches its child, alone, shared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.runner import run_ok

pytestmark = pytest.mark.model


def test_every_wait_setting_runs_in_a_child_of_its_own_alone_and_beside_a_busy_process(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "spin"
    run_ok(
        "bench.studies.omp_spin", "--model-dir", str(tiny_model_dir),
        "--settings", "passive,spin 3000", "--hogs", "1", "--out", str(out),
        timeout=600,
    )  # fmt: skip
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert list(rows) == ["passive", "spin 3000"]
    assert rows["passive"]["alone"]["env_seen"] == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert rows["spin 3000"]["shared"]["env_seen"] == {"GOMP_SPINCOUNT": "3000"}
    for row in rows.values():
        assert (row["alone"]["hogs"], row["shared"]["hogs"]) == (0, 1)
        for where in ("alone", "shared"):
            assert all(row[where][b]["ms"] > 0 for b in ("b1", "b8"))
    assert "| spin 3000 |" in out.with_suffix(".md").read_text()
