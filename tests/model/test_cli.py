"""The ``chattts-stream`` command as a user runs it: offline failure, and the dev-model flag."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path

import pytest

from tests.serverproc import free_port, http_status, spawn_server, wait_ready

pytestmark = pytest.mark.loopback  # the server subprocess on 127.0.0.1


async def test_serve_without_weights_offline_fails_fast_with_one_actionable_line(tmp_path: Path) -> None:
    # Issue #17's "a model that fails to load" as a user meets it: exit 2, one line, no abort.
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HOME": str(tmp_path),
        "CHATTTS_CACHE_DIR": str(tmp_path / "c"),
    }
    proc = await spawn_server(
        *("--engine", "chattts", "--port", str(free_port())),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(240):  # a bound for a loaded machine, not a speed claim
        _, stderr = await proc.communicate()
    assert proc.returncode == 2
    last = stderr.decode().strip().splitlines()[-1]
    assert last.startswith("chattts-stream: ") and "--model-dir" in last
    assert "HF_HUB_OFFLINE" in last  # it failed on the offline check: no download was tried
    assert "Traceback" not in stderr.decode() and "terminate called" not in stderr.decode()


async def test_dev_model_flag_serves_random_weights_loudly_and_drains(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CHATTTS_CACHE_DIR": str(tmp_path)}
    proc = await spawn_server(
        *("--dev-model", "tiny", "--port", str(port), "--device", "cpu"),
        env=env,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await wait_ready(port, proc, timeout_s=180)  # make, load, warm up a model on a busy 2-core CPU
        assert await asyncio.to_thread(http_status, port, "/ready") == 200
        assert (tmp_path / "dev-tiny" / "DEV_MODEL.json").is_file()
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            _, stderr = await proc.communicate()
        assert proc.returncode == 0
        assert "RANDOM WEIGHTS" in stderr.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_a_model_that_fails_to_load_names_its_flag_on_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Broken weights (a truncated download): one line naming the folder and ``--model-dir``."""
    from server.config import load_settings
    from server.engine.loading import ModelUnavailable, chattts_engine_factory

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    victim = max((p for p in (broken / "asset").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    settings = load_settings(["--model-dir", str(broken), "--device", "cpu"], env={})
    with pytest.raises(ModelUnavailable) as failed:
        chattts_engine_factory(settings)()
    message = str(failed.value)
    assert "\n" not in message and str(broken) in message and "--model-dir" in message
