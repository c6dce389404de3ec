"""``bench.harness.servers``: the inference thread from two ``/metrics`` scrapes; a server's CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from bench.harness.servers import _children, engine_thread_figures, process_cpu_s


def test_figures_are_the_differences_between_the_scrapes() -> None:
    names = ("chattts_block_seconds_count", "chattts_block_seconds_sum", "chattts_block_tokens_sum",
             "chattts_batch_size_sum")  # fmt: skip
    before = dict(zip(names, (10, 2.0, 80, 20), strict=True))
    after = dict(zip(names, (30, 11.0, 380, 100), strict=True))
    figures = engine_thread_figures(before, after, wall_s=10.0)
    assert figures == {
        "engine_steps": 20,
        "engine_busy": 0.9,  # 9 s of steps in 10 s
        "tokens_per_block": 15.0,  # 300 token steps in 20 steps
        "rows_per_step": 4.0,
        "step_ms_per_token": pytest.approx(30.0),  # 9 s over 300 token steps
    }


def test_a_server_without_the_block_tokens_histogram_has_no_token_figures() -> None:
    before = {"chattts_block_seconds_count": 0, "chattts_block_seconds_sum": 0.0, "chattts_batch_size_sum": 0}
    after = {"chattts_block_seconds_count": 5, "chattts_block_seconds_sum": 1.0, "chattts_batch_size_sum": 5}
    figures = engine_thread_figures(before, after, wall_s=2.0)
    assert figures["engine_busy"] == 0.5 and figures["rows_per_step"] == 1.0
    assert figures["tokens_per_block"] is None and figures["step_ms_per_token"] is None  # not 0.0: unknown


def test_a_servers_cpu_counts_the_processes_it_started() -> None:
    # A server with --engine-process spends part of its CPU in its engine process.
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"]
    )
    try:
        deadline = time.monotonic() + 30
        while (process_cpu_s(parent.pid) or 0.0) < 0.3:
            assert time.monotonic() < deadline, "the child's CPU never counted"
            time.sleep(0.05)
    finally:
        for child in _children(parent.pid):
            os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait()
