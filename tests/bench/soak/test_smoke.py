"""``python -m bench.soak`` in a few seconds against a fake-engine server subprocess.

Runs the soak harness as CI does (a short mix of every request kind, a short resume
TTL) and checks that its JSON has every field, that every started stream is accounted
for (zero lost), that every request got the outcome and error code it expected, and
that the server freed every stream and exited 0 on SIGTERM. RSS growth is not judged
here: a run of a few seconds is all warm-up.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench.runner import run_module

TOP_KEYS = {
    "schema", "created", "command", "machine", "config", "server", "load_wall_s", "requests_per_s",
    "memory", "accounting", "kinds", "errors", "problems", "cache", "end", "acceptance", "requests",
    "samples",
}  # fmt: skip
RSS_KEYS = {
    "idle_before_mib", "baseline_mib", "end_mib", "growth_pct", "window_s", "first_window_median_mib",
    "last_window_median_mib", "growth_robust_pct", "post_warmup_max_mib", "post_warmup_min_mib",
    "slope_mib_per_hour", "max_mib", "idle_after_mib",
}  # fmt: skip
FD_KEYS = {
    "idle_before", "idle_after", "idle_after_max", "start", "end", "max",
    "post_warmup_first_window_median", "post_warmup_last_window_median", "growth_idle",
}  # fmt: skip
SAMPLE_KEYS = {
    "t", "phase", "rss_bytes", "fds", "threads", "cpu_s", "requests_done", "active_streams",
    "queue_depth", "connections", "running_sequences", "cache_bytes",
}  # fmt: skip
REQUEST_KEYS = {
    "index", "kind", "sub", "fmt", "size", "chars", "outcome", "problem", "started", "done",
    "abandoned_freed", "expected_errors", "received_errors", "frames", "resumes", "t_start", "t_end", "lost",
}  # fmt: skip
KINDS = {"complete", "repeat", "cancel", "abandon", "resume", "incremental", "multi"}


def test_soak_smoke_accounts_for_every_stream(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    flags = "--engine fake --requests 120 --concurrency 8 --resume-ttl-s 2 --free-margin-s 1 --idle-s 0.6"
    # A 2 s TTL: with 0.5 s a resume after a pause on a loaded 2-core machine could arrive too late.
    flags += " --sample-interval-s 0.2 --window-s 1 --seed 3"
    argv = [*flags.split(" "), "--out", str(out)]
    # The timeout is a bound for a loaded machine; the smoke's size keeps it short, not an assert.
    proc = run_module("bench.soak", *argv, timeout=240)
    # Exit 1 is allowed: a few seconds of load cannot show flat RSS; the other checks are asserted below.
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    assert out.exists(), proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| streams started / done" in out.with_suffix(".md").read_text()

    assert set(results) >= TOP_KEYS
    assert results["schema"] == "chattts-stream-soak/1"
    memory = results["memory"]
    assert set(memory["rss"]) == RSS_KEYS and set(memory["fds"]) == FD_KEYS
    assert 0 < memory["warmup_end_s"] < memory["load_end_s"]
    assert memory["rss"]["baseline_mib"] > 0 and memory["fds"]["max"] > 0
    phases = {s["phase"] for s in results["samples"]}
    assert {"idle_before", "load", "idle_after"} <= phases
    assert all(set(s) == SAMPLE_KEYS for s in results["samples"])
    assert all(s["active_streams"] is not None for s in results["samples"])

    accounting = results["accounting"]
    assert accounting["requests"] == 120 == len(results["requests"])
    assert accounting["lost"] == 0 and accounting["balanced"], results["problems"][:5]
    assert accounting["started"] == accounting["done"] + accounting["abandoned_freed"]
    assert accounting["abandoned_freed"] > 0
    assert results["problems"] == []
    assert all(set(r) == REQUEST_KEYS and r["lost"] == 0 for r in results["requests"])
    assert set(results["kinds"]) >= KINDS
    assert any(k.startswith("bad:") for k in results["kinds"])
    assert results["errors"]["expected"] == results["errors"]["received"]
    assert results["errors"]["received"].get("unknown_stream", 0) == accounting["abandoned_freed"]
    assert results["cache"]["hits"] > 0  # the repeated seeds

    checks = results["acceptance"]["checks"]
    assert set(checks) == {
        "rss_growth_under_5pct", "no_fd_growth", "zero_lost_streams", "every_request_as_expected",
        "active_streams_back_to_0", "clean_exit_on_sigterm",
    }  # fmt: skip
    for name in ("zero_lost_streams", "every_request_as_expected", "active_streams_back_to_0"):
        assert checks[name], name
    assert checks["clean_exit_on_sigterm"] and results["end"]["exit_code"] == 0
    assert checks["no_fd_growth"], memory["fds"]
    assert results["acceptance"]["pass"] == all(checks.values())
    assert (proc.returncode == 0) == results["acceptance"]["pass"]
