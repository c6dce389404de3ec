"""``python -m bench.studies.stream_timeline``: where each stream's audio arrived, one stream at a time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.harness.latency import StreamRecord
from bench.studies.stream_timeline import blocks, stream_row, summary
from tests.bench.runner import run_ok


def test_frames_close_together_are_one_block_with_the_audio_so_far() -> None:
    record = StreamRecord(job=0, system="server", fmt="pcm16", t_send=10.0)
    # Two blocks: three frames at 10.20-10.21 s (1536 samples: 3 tokens), two at 10.50 s (8192: 16 tokens).
    record.frames = [(10.20, 512), (10.205, 512), (10.21, 512), (10.50, 4096), (10.501, 4096)]
    assert blocks(record, merge_s=0.02) == [(0.2, 3.0, 0.064), (0.5, 16.0, 0.405)]
    assert len(blocks(record, merge_s=0.001)) == 4  # merged only when closer than merge_s


def test_a_gap_longer_than_the_buffer_is_an_underrun_and_counts_in_the_summary() -> None:
    smooth = StreamRecord(job=0, system="server", fmt="pcm16", t_send=0.0)
    smooth.frames = [(0.1 * k, 2400) for k in range(1, 51)]  # 0.1 s of audio every 0.1 s: 5 s
    stalled = StreamRecord(job=1, system="server", fmt="pcm16", t_send=0.0)
    stalled.frames = [(0.1 * k, 2400) for k in range(1, 26)] + [(3.5 + 0.1 * k, 2400) for k in range(25)]
    rows = [stream_row(r, jitter_ms=300.0, merge_s=0.02) for r in (smooth, stalled)]
    assert rows[0]["underruns"] == 0 and rows[1]["underruns"] == 1  # 1 s without audio, 0.3 s buffered
    assert rows[1]["max_gap_s"] == pytest.approx(1.0)
    assert summary(rows, long_s=4.0) == {
        "streams": 2, "long_streams": 2, "long_rtf_p50": (rows[0]["rtf"] + rows[1]["rtf"]) / 2,
        "long_underrun_streams": 1, "errors": 0,
    }  # fmt: skip


def test_streams_against_a_server_it_starts(tmp_path: Path) -> None:
    out = tmp_path / "timeline.json"
    proc = run_ok(
        "bench.studies.stream_timeline", "--server-flags", "--engine fake", "--streams", "2",
        "--max-audio-s", "1", "--out", out, timeout=120,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["summary"]["streams"] == 2 and result["summary"]["errors"] == 0
    for row in result["streams"]:
        times = [t for t, _, _ in row["blocks"]]
        assert times == sorted(times) and times[0] > 0
        assert abs(row["blocks"][-1][2] - row["audio_s"]) < 1e-3  # the blocks hold all the audio
    assert "stream 1:" in proc.stdout
