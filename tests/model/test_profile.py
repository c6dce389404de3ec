"""A server started with the default flags on a CPU runs the compiled step (``--profile realtime``).

The one test that starts a server without the harness's ``--profile eager``
(``tests/conftest.py``): it compiles the tiny model's step, minutes on a loaded 2-core machine,
so it is the only one. ``--max-batch 1`` keeps the compile to batch 1's graphs; no step flag
(``--profile``, ``--compile-step``, ``--quantize``, ``--dtype``) is given.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from server.engine.chattts.step.w8a8 import quantized_engine_available
from tests.model.helpers import TEST_DEVICE
from tests.serverproc import free_port, spawn_server, wait_ready
from tests.wsclient import open_client

pytestmark = pytest.mark.loopback  # the server subprocess on 127.0.0.1

#: What the harness may set that would change the step: none of it reaches this server.
STEP_VARIABLES = ("CHATTTS_PROFILE", "CHATTTS_COMPILE_STEP", "CHATTTS_QUANTIZE", "CHATTTS_DTYPE")


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU's default step")
@pytest.mark.timeout(1500)  # one compile of the tiny model's step on a loaded 2-core machine
async def test_a_server_with_default_flags_runs_the_compiled_step(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in STEP_VARIABLES}
    env |= {"HF_HUB_OFFLINE": "1", "CHATTTS_CACHE_DIR": str(tmp_path / "cache")}
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:  # a file, not a pipe: minutes of compile logs must not block it
        proc = await spawn_server(
            *("--model-dir", str(tiny_model_dir), "--port", str(port), "--device", "cpu", "--max-batch", "1"),
            env=env,
            stderr=log.fileno(),
            profile=None,
        )
    try:
        await wait_ready(port, proc, timeout_s=1400)
        ws, hello = await open_client(port)
        await ws.close()
        quantize = "w8a8" if quantized_engine_available() else "none"
        compute = hello["compute"]
        assert compute["token_step"] == "compiled", compute.get("token_step_fallback")
        assert compute["quantize"] == quantize
        logged = log_path.read_text()
        how = "ahead" if quantize == "w8a8" else "on"  # w8a8's graphs are built ahead and saved
        assert f"profile realtime on cpu: set --compile-step {how}, --quantize {quantize}" in logged
        assert "TOKEN STEP FALLBACK" not in logged
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(60):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
