"""The engine in its own process (``--engine-process``): the same streams, metrics and readiness.

Real servers, real sockets, a real engine process (``python -m server.core.remote.host``)
with the fake engine; a stream is byte-equal to the in-process form's, the core's metrics
reach this process's ``/metrics``, and killing the engine process fails its streams with
``engine_error`` and makes the server not ready until the restarted process is ready.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from server.app import App
from server.core.client import EngineClient
from server.core.factory import build_engine_factory, policy_config
from server.core.remote.link import ProcessLink
from server.engine_api import EngineInfo, EngineText
from server.errors import StartupError
from server.metrics import Metrics
from tests.integration.conftest import MakeApp, fake_settings, wait_until
from tests.integration.test_voices import encoded, expected_pcm, form, recording, upload, ws_stream
from tests.serverproc import free_port, http_status, spawn_server, wait_ready
from tests.wsclient import collect, open_client, recv, start, stream_payload

TEXT = "Hello there. This crosses a process boundary. 最后一句话。"
READY_TIMEOUT_S = 30.0


def link_of(app: App) -> ProcessLink:
    link = app.engine_client.link
    assert isinstance(link, ProcessLink)
    return link


@pytest.mark.parametrize("fmt", ["pcm16", "opus", "f32"])
async def test_a_stream_is_byte_equal_to_the_in_process_form(make_app: MakeApp, fmt: str) -> None:
    one = await make_app()
    two = await make_app("--engine-process")
    assert link_of(two).pid not in (None, os.getpid())
    await wait_until(lambda: two.ready, READY_TIMEOUT_S)
    fields = {"text": TEXT, "seed": 11, "format": fmt}
    reference = await stream_payload(one.port, **fields)
    crossed = await stream_payload(two.port, **fields)
    assert len(crossed) > 1000 and crossed == reference


async def test_the_core_metrics_and_the_pace_reach_the_front_end(make_app: MakeApp) -> None:
    app = await make_app("--engine-process")
    await wait_until(lambda: app.ready, READY_TIMEOUT_S)  # the warm-up ran through the engine process
    await stream_payload(app.port, text=TEXT, seed=3)
    text = app.metrics.render().decode()
    values = {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"
    }
    assert values["chattts_tokens_generated_total"] > 0
    assert values["chattts_block_seconds_count"] > 0
    assert values["chattts_audio_generated_seconds_total"] > 0
    # The warm-up's steps gave the pace points: the buffer advice is measured, not a default.
    assert app.service.pace.expectation("fake").find("no step measured") < 0


async def test_killing_the_engine_process_fails_its_streams_and_readiness_comes_back(
    make_app: MakeApp,
) -> None:
    # Slow steps: the stream is still running when the engine process is killed.
    app = await make_app("--engine-process", "--fake-step-ms", "40")
    await wait_until(lambda: app.ready, READY_TIMEOUT_S)
    ws, _ = await open_client(app.port)
    try:
        await start(ws, id="cut", text=TEXT * 4, seed=5)
        while isinstance(await recv(ws), str):
            pass  # started, segment: until a first frame (the stream runs in the engine process)
        pid = link_of(app).pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        messages = []
        while not messages or messages[-1].get("type") != "done":
            if isinstance(raw := await recv(ws), str):
                messages.append(json.loads(raw))
        errors = [m for m in messages if m["type"] == "error"]
        assert [e["code"] for e in errors] == ["engine_error"] and "engine process" in errors[0]["message"]
        assert messages[-1]["reason"] == "error"
        assert not app.ready  # the engine process is gone: a balancer routes elsewhere meanwhile
        await wait_until(lambda: app.ready, READY_TIMEOUT_S)
        assert link_of(app).pid not in (None, pid)
        assert app.healthy
        # The new engine process serves.
        await start(ws, id="again", text=TEXT, seed=5)
        again = (await collect(ws, {"again"}))["again"]
        assert again.done is not None and again.done["reason"] == "complete"
    finally:
        await ws.close()


async def test_an_engine_given_in_code_is_refused_with_the_engine_process() -> None:
    # The engine process builds its engine from the flags (ChatTTS too): no engine object crosses.
    settings = fake_settings("--engine-process")
    with pytest.raises(StartupError, match="--engine-process"):
        App(settings, engine_factory=build_engine_factory(settings))


async def test_a_text_side_that_cannot_be_built_fails_the_start_and_stops_the_engine_process() -> None:
    # The front end builds its text side from the engine's Loaded; one that fails is a failed load.
    def broken(info: EngineInfo) -> EngineText:
        raise OSError(f"no tokenizer for {info.name}")

    settings = fake_settings("--engine-process")
    link = ProcessLink(settings, text=broken, metrics=Metrics())
    client = EngineClient(config=policy_config(settings), metrics=Metrics(), link=link)
    try:
        async with asyncio.timeout(READY_TIMEOUT_S):
            with pytest.raises(
                StartupError, match=r"text side cannot be loaded.*OSError: no tokenizer for fake"
            ):
                await client.start()
    finally:
        process = link._process
        if process is not None and process.returncode is None:  # left running: the bug this catches
            process.kill()
            await process.wait()
    assert process is not None and process.returncode == 0  # stopped in order, and waited for
    with pytest.raises(RuntimeError, match="text side"):
        link.text.validate_voice("default")


async def test_the_engine_process_ends_with_the_server(make_app: MakeApp) -> None:
    app = await make_app("--engine-process")
    link = link_of(app)
    process = link._process
    assert process is not None
    await app.stop()
    assert process.returncode == 0  # it stopped in order (a Shutdown command), not killed
    await asyncio.sleep(0)


async def test_a_voice_from_a_recording_is_made_and_spoken_across_the_process(
    make_app: MakeApp, tmp_path: Path
) -> None:
    # The recording goes to the engine process as raw float32 (EncodeVoice), its codes come back
    # (VoiceEncoded), and a stream in that voice carries them back there inside its parameters.
    app = await make_app("--engine-process", "--voices-dir", str(tmp_path))
    status, voice = await upload(app, form(encoded(recording())))
    assert status == 200, voice
    sample = app.service.voices.get(voice["id"])
    assert sample is not None
    log = await ws_stream(app, text=TEXT, voice=voice["id"], seed=5)
    assert log.done["reason"] == "complete"
    assert log.payload == expected_pcm(TEXT, voice["id"], sample.sample, 5)


def children_of(pid: int) -> set[int]:
    """The processes ``pid`` started that still run (Linux: its threads' ``children`` files)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(child) for child in (task / "children").read_text().split()}
    return found


def gone(pid: int) -> bool:
    """No process ``pid`` runs (reaped, or a zombie nobody waited for)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def test_the_served_command_drains_and_leaves_no_engine_process_behind() -> None:
    # As a user runs it: SIGTERM drains the front end, which stops the engine process in order.
    port = free_port()
    proc = await spawn_server(
        "--engine",
        "fake",
        "--engine-process",
        "--port",
        str(port),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        await wait_ready(port, proc)
        (engine,) = children_of(proc.pid)
        assert await asyncio.to_thread(http_status, port, "/metrics") == 200
        os.kill(engine, signal.SIGKILL)
        async with asyncio.timeout(READY_TIMEOUT_S):  # not ready, then ready again
            while await asyncio.to_thread(http_status, port, "/ready") == 200:
                await asyncio.sleep(0.02)
        await wait_ready(port, proc)
        (restarted,) = children_of(proc.pid)
        assert restarted != engine
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(READY_TIMEOUT_S):
            assert await proc.wait() == 0
        assert gone(restarted)  # the server waited for it before exiting
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_the_engine_process_ends_when_its_front_end_is_killed() -> None:
    # No orphan: the engine process reads EOF on its socket when the front end dies, and exits.
    port = free_port()
    flags = ("--engine", "fake", "--engine-process", "--port", str(port))
    proc = await spawn_server(*flags, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        await wait_ready(port, proc)
        (engine,) = children_of(proc.pid)
        proc.kill()
        await proc.wait()
        async with asyncio.timeout(READY_TIMEOUT_S):
            while not gone(engine):
                await asyncio.sleep(0.05)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
