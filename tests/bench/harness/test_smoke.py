"""``python -m bench --smoke``: a real fake-engine server subprocess and real WebSocket clients.

Runs the harness as CI does and checks that the JSON it writes has every
field, with sane values (time to first audio > 0, no errors, both formats).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from tests.bench.runner import REPO, run_ok

STREAM_KEYS = {
    "job", "system", "format", "text_size", "text_lang", "ok", "reason", "errors", "capped", "cut",
    "connect_s", "ttfa_s", "ttfs_s", "leading_silence_s", "audio_s", "frames", "gen_s", "rtf",
    "max_gap_s", "listener",
}  # fmt: skip
DISTRIBUTIONS = ("ttfa_s", "ttfs_s", "leading_silence_s", "rtf", "max_gap_s", "gap_s", "connect_s", "audio_s")


def _check_distribution(dist: dict[str, Any], *, positive: bool = False) -> None:
    assert set(dist) == {"n", "mean", "p50", "p90", "p99", "max"}
    assert dist["n"] > 0
    assert dist["p50"] <= dist["p90"] <= dist["p99"] <= dist["max"]
    if positive:
        assert dist["p50"] > 0


def test_smoke_writes_complete_sane_results(tmp_path: Path) -> None:
    prefix = tmp_path / "smoke"
    began = time.monotonic()
    run_ok("bench", "--smoke", "--out", str(prefix), timeout=60)
    elapsed = time.monotonic() - began
    assert elapsed < 20, f"smoke took {elapsed:.1f} s"
    results = json.loads(prefix.with_name("smoke.json").read_text())
    assert "| server | c1 | pcm16 |" in prefix.with_name("smoke.md").read_text()

    for key in (
        "schema",
        "title",
        "created",
        "command",
        "machine",
        "settings",
        "systems",
        "scenarios",
        "issue4",
    ):
        assert key in results
    machine = results["machine"]
    assert machine["cpu_model"] and machine["cpu_cores"] >= 1 and isinstance(machine["gpus"], list)
    assert {"python", "torch", "websockets"} <= set(machine["versions"])
    server = results["systems"]["server"]
    assert server["hello"]["type"] == "hello" and server["hello"]["protocol"] == 1
    assert "--engine" in server["server"]["flags"] and server["server"]["exit_code"] == 0
    assert "--max-batch" in results["systems"]["server-b1"]["server"]["flags"]
    assert {s["what"] for s in results["skipped"]} == {"chattts-infer", "engine-direct"}  # no model in smoke

    seen = {(s["system"], s["label"], s["format"]) for s in results["scenarios"]}
    for fmt in ("pcm16", "opus"):
        assert {("server", "c1", fmt), ("server", "c4", fmt), ("server", "r8", fmt)} <= seen
    assert ("server-b1", "c4", "pcm16") in seen
    for scenario in results["scenarios"]:
        summary = scenario["summary"]
        assert summary["streams"] > 0 and summary["ok"] == summary["streams"], summary["errors"]
        assert summary["errors"] == {} and summary["error_streams"] == 0 and summary["cut"] == 0
        for key in DISTRIBUTIONS:
            _check_distribution(summary[key], positive=key in ("ttfa_s", "ttfs_s", "audio_s", "connect_s"))
        assert summary["rtf"]["p50"] > 0  # (speed is the bench's to show, not a test's to assert)
        throughput = summary["throughput"]
        assert throughput["audio_s_per_wall_s"] > 0 and throughput["steady_audio_s_per_wall_s"] > 0
        assert throughput["cpu_s"] is not None and throughput["cpu_s"] > 0  # the harness started the server
        assert throughput["client_cpu_s"] > 0 and throughput["client_cores"] > 0  # and ran the client
        assert [x["threshold_ms"] for x in summary["listener"]] == [100.0, 300.0]
        for stream in scenario["streams"]:
            assert set(stream) == STREAM_KEYS
            assert stream["ok"] and stream["ttfa_s"] > 0 and stream["audio_s"] > 0
            assert stream["ttfa_s"] <= stream["ttfs_s"]  # the fake tones are loud from the first sample
            assert stream["listener"][0]["start_s"] >= stream["ttfa_s"]
    ratios = results["issue4"]
    assert ratios["server_audio_s_per_wall_s"] > 0 and ratios["vs_single"] > 0


def test_listener_jitter_buffer_counts_underruns_and_stall() -> None:
    from bench.harness.listener import simulate

    # 20 ms frames arriving exactly in real time after 1 s: starts at the threshold, never stalls.
    steady = [(1.0 + 0.02 * i, 0.02) for i in range(50)]
    result = simulate(steady, 0.1)
    assert result.start_s == 1.08 and result.underruns == 0 and result.stall_s == 0.0
    # Bursts of 0.3 s of audio every 0.5 s: dry 0.2 s before each of the 4 later bursts.
    bursts = [(0.5 * k + 0.001 * i, 0.02) for k in range(1, 6) for i in range(15)]
    result = simulate(bursts, 0.1)
    assert result.underruns == 4 and abs(result.stall_s - 0.8) < 1e-9
    # A bigger buffer stalls less often; an empty end marker after the audio is no underrun.
    assert simulate(bursts, 0.5).underruns == 1
    assert simulate([(0.0, 0.1), (5.0, 0.0)], 0.05).underruns == 0


async def test_smoke_honours_url(tmp_path: Path) -> None:
    # A server the test starts, not the harness: ``--smoke --url`` must measure it and start none.
    from bench.harness.servers import ServerProcess

    server = ServerProcess(["--engine", "fake", "--fake-step-ms", "5", "--fake-row-ms", "0.5"])
    await server.start(timeout_s=60)
    try:
        prefix = tmp_path / "smoke-url"
        bench = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench", "--smoke", "--url", server.url, "--out", str(prefix),
            cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        async with asyncio.timeout(60):
            output, _ = await bench.communicate()
        assert bench.returncode == 0, output.decode()[-3000:]
    finally:
        assert await server.stop() == 0
    results = json.loads(prefix.with_name("smoke-url.json").read_text())
    measured = results["systems"]["server"]
    assert measured["url"] == server.url and measured["server"] is None  # no server of its own
    assert results["settings"]["url"] == server.url
    assert "server-b1" in {s["what"] for s in results["skipped"]}  # no --baseline-url given
    scenarios = [s for s in results["scenarios"] if s["system"] == "server"]
    assert {s["format"] for s in scenarios} == {"pcm16", "opus"}
    for scenario in scenarios:
        assert scenario["summary"]["ok"] == scenario["summary"]["streams"] > 0
