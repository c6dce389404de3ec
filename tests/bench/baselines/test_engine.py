"""``python -m bench.baselines.engine``: a level above the engine's default slot count still runs."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench.runner import run_ok


def test_engine_direct_gives_every_stream_of_its_largest_level_a_slot(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "direct.json"
    run_ok(
        "bench.baselines.engine", "--model-dir", tiny_model_dir, "--concurrency", "17", "--duration", "1",
        "--max-streams", "17", "--max-audio-s", "0.5", "--threads", "1", "--out", out,
        timeout=600,
    )  # fmt: skip
    (scenario,) = json.loads(out.read_text())["scenarios"]
    assert scenario["concurrency"] == 17
    records = scenario["records"]
    assert len(records) == 17  # 17 streams ran at once: the 17th found a KV slot (default: 16)
    assert all(r["reason"] == "complete" or r["cut"] or r["capped"] for r in records)
    figures = scenario["engine_thread"]  # its steps, with the keys a server's /metrics gives
    assert figures["engine_steps"] > 0 and 0 < figures["engine_busy"] <= 1
    assert 1 <= figures["rows_per_step"] <= 17 and figures["tokens_per_block"] > 0
    assert figures["step_ms_per_token"] > 0


def test_a_job_ends_at_the_audio_cap_like_a_cancelled_stream(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``--max-audio-s`` caps a job's audio in all, as the harness caps a stream, not each segment."""
    out = tmp_path / "direct.json"
    run_ok(
        "bench.baselines.engine", "--model-dir", tiny_model_dir, "--concurrency", "4", "--duration", "2",
        "--max-streams", "8", "--max-audio-s", "0.5", "--text-sizes", "long", "--threads", "1",
        "--out", out, timeout=600,
    )  # fmt: skip
    (scenario,) = json.loads(out.read_text())["scenarios"]
    cap = round(0.5 * 24_000)
    totals = [sum(n for _, n in r["frames"]) for r in scenario["records"]]
    assert totals and all(total <= cap for total in totals)
    capped = [r for r in scenario["records"] if r["capped"]]
    assert capped and all(r["reason"] == "cancelled" and not r["cut"] for r in capped)
    # Credited exactly the cap, as the harness credits a server stream it cancels there: the
    # block that crossed the cap made more, but the harness's client drops what follows the cap.
    assert all(sum(n for _, n in r["frames"]) == cap for r in capped)
