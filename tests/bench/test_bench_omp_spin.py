"""``python -m bench.omp_spin`` on the tiny model: each setting reaches its own child, alone and shared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.model


def test_every_wait_setting_runs_in_a_child_of_its_own_alone_and_beside_a_busy_process(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "spin"
    proc = subprocess.run(
        [
            sys.executable, "-m", "bench.omp_spin", "--model-dir", str(tiny_model_dir),
            "--settings", "passive,spin 3000", "--hogs", "1", "--out", str(out),
        ],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert list(rows) == ["passive", "spin 3000"]
    assert rows["passive"]["alone"]["env_seen"] == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert rows["spin 3000"]["shared"]["env_seen"] == {"GOMP_SPINCOUNT": "3000"}
    for row in rows.values():
        assert (row["alone"]["hogs"], row["shared"]["hogs"]) == (0, 1)
        for where in ("alone", "shared"):
            assert all(row[where][b]["ms"] > 0 for b in ("b1", "b8"))
    assert "| spin 3000 |" in out.with_suffix(".md").read_text()
