"""``python -m bench.words`` end to end, one speaking rate: espeak-ng speech, the aligner, the report.

Needs espeak-ng (scripts/setup.sh --dev installs it). The numbers are deterministic (espeak-ng
and the seeded noise), so the English targets of issue 26 and the gain over the naive
baselines hold here as in the committed bench/results/words/xeon-2core.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench.runner import run_ok


def test_word_timing_writes_its_report_and_beats_the_baselines(tmp_path: Path) -> None:
    out = tmp_path / "wt"
    run_ok("bench.words", "--rates", "180", "--out", str(out), timeout=240)
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["command"] == f"python -m bench.words --rates 180 --out {out}"
    assert record["reference_check"]["pause_rms_max"] == 0.0  # espeak-ng's pauses are silent
    assert record["reference_check"]["word_rms_min"] > 0.01
    results = record["results"]
    shipped = results["weights + pauses + snapping (shipped)"]
    for lang in ("en", "zh"):
        assert shipped[lang]["boundaries"] > 300
        for baseline in (
            "characters over the whole span (segment marks only)",
            "weights over the speech, no pauses, no snapping",
        ):
            assert shipped[lang]["mean_ms"] < results[baseline][lang]["mean_ms"]
    assert shipped["en"]["mean_ms"] <= 80 and shipped["en"]["p90_ms"] <= 150
    for table in (
        "| weights + pauses + snapping (shipped) | en |",
        "| held out | language |",
        "| 35 dB | zh |",
    ):
        assert table in out.with_suffix(".md").read_text()
