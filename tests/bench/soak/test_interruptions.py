"""``python -m bench.soak.interruptions`` end to end, small: pipecat and LiveKit, 3 interruptions each."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench.runner import run_module


def test_interruptions_smoke_frees_every_interrupted_stream(tmp_path: Path) -> None:
    out = tmp_path / "interruptions"
    argv = ["--rounds", "3", "--speak-s", "0.5", "--gap-s", "1.0", "--drain-timeout-s", "10"]
    proc = run_module("bench.soak.interruptions", *argv, "--release-s", "5", "--out", str(out), timeout=240)
    results = json.loads(out.with_suffix(".json").read_text())
    assert set(results["clients"]) == {"pipecat", "livekit"}
    for name, client in results["clients"].items():
        # Every interruption freed its stream (a bound for a loaded machine: 5 s, not a timing claim).
        assert client["interruptions"] == 3 and client["released_within"] == 3, (name, client)
    assert results["sigterm"]["exit_code"] == 0
    assert results["checks"]["sigterm_exit_0_within_the_drain_timeout"], results["sigterm"]
    assert proc.returncode == 0, proc.stdout[-2000:]
