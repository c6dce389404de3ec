"""``python -m bench --advice``: the simulated listener that honours the server's buffer advice.

A fake-engine server whose step (0.6 s a block of 0.34 s of audio) is slower than real time
for every stream, at one stream and at four. A listener on a fixed 100 ms buffer stalls; one
that starts on the server's ``started.buffer_ms`` (at least 300 ms) is reported beside it and
starts later than the fixed 300 ms listener. Whether it stalls depends on the wall clock of a
loaded machine, so it is not asserted here: ``bench/results/harness/buffer-advice-*`` shows it,
and tests/unit/test_pace.py checks the figure against the listener model.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench.runner import run_ok


def test_the_advised_listener_never_stalls_on_a_server_slower_than_real_time(tmp_path: Path) -> None:
    prefix = tmp_path / "advice"
    run_ok(
        "bench",
        *("--engine", "fake", "--server-flags", "--fake-step-ms 600 --fake-row-ms 10"),
        *("--concurrency", "1,4", "--duration", "1", "--max-streams", "4", "--grace-s", "30"),
        *("--formats", "pcm16", "--baselines", "", "--text-sizes", "short", "--no-plots"),
        *("--jitter-ms", "300,100", "--advice", "--out", str(prefix)),
        timeout=300,
    )
    results = json.loads(prefix.with_name("advice.json").read_text())
    assert "advised listener" in prefix.with_name("advice.md").read_text()
    assert {s["label"] for s in results["scenarios"]} == {"c1", "c4"}
    for scenario in results["scenarios"]:
        summary = scenario["summary"]
        assert summary["ok"] == summary["streams"] > 0
        fixed = {x["threshold_ms"]: x for x in summary["listener"]}
        advised = summary["advised"]
        assert fixed[100.0]["streams_with_underruns"] > 0  # slower than real time: 100 ms stalls
        assert advised["threshold_ms"]["p50"] > 300  # the server advised more than the floor
        assert advised["start_s"]["p50"] >= fixed[300.0]["start_s"]["p50"]  # the price: a later start
        for stream in scenario["streams"]:
            assert stream["advised"]["advice_ms"] is not None
