"""ChatTTS (the tiny random-weight model) in an engine process of its own, and behind two front ends.

``--engine chattts --engine-process``: the front end holds only the text side (tokenizer,
normalizer, speaker statistics), loaded from the folder the engine process reported in its
``Loaded``; streams are byte-equal to the one-process form's, and the text side answers as the
engine does. ``--engine chattts --frontend-processes 2`` (as a user runs it): a stream on each
child completes, byte-equal to the one-process form's. A voice made from a recording in the
engine process has the one-process form's codes and speaks the same bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from server.app import App
from server.config import load_settings
from server.core.remote.link import ProcessLink
from server.engine.chattts.textside import TextSide
from tests.integration.test_engine_process import children_of
from tests.integration.test_frontend_processes import Served, holder, ready_status
from tests.integration.test_voices import encoded, form, recording, upload
from tests.model.helpers import TEST_DEVICE
from tests.serverproc import free_port, spawn_server, wait_ready
from tests.wsclient import collect, open_client, start, stream_payload

pytestmark = pytest.mark.loopback  # our own servers on 127.0.0.1, nothing else

TEXT = "第一句话在这里。The second one has 3 words."
#: Byte-equal streams need a schedule that depends on tokens only (tests/model/test_chattts_server.py).
DETERMINISTIC_SCHEDULE = ("--lookahead-lead-s", "0")
#: Three processes load torch and the model on a loaded two-core machine: generous, never tight.
DEADLINE_S = 300.0
VOICE_CHECKS = ("default", "seed:7", "seed:x", "alloy", "")
TEXT_CHECKS = (
    "",
    TEXT,
    "It is 10:30 on 2026-01-05.",
    "[uv_break] 你好 [laugh]",
    "The year 1999 again. " * 30,
)


def model_flags(model_dir: Path) -> list[str]:
    """The tiny model, float32, eager: the flags every server here runs with."""
    return [
        *("--engine", "chattts", "--model-dir", str(model_dir), "--device", TEST_DEVICE),
        *("--dtype", "float32", "--profile", "eager", "--cache-bytes", "0", *DETERMINISTIC_SCHEDULE),
    ]


@pytest.fixture
async def one_process(make_model_app: Any) -> App:
    app: App = await make_model_app(*DETERMINISTIC_SCHEDULE)
    return app


@pytest.fixture
async def make_engine_process(tiny_model_dir: Path) -> AsyncIterator[Callable[..., Awaitable[App]]]:
    """Start ``--engine chattts --engine-process`` servers in this process, warmed up; stopped after."""
    apps: list[App] = []

    async def make(*flags: str) -> App:
        base = [*model_flags(tiny_model_dir), "--host", "127.0.0.1", "--port", "0", "--engine-process"]
        app = App(load_settings([*base, *flags], env={}))
        apps.append(app)
        async with asyncio.timeout(DEADLINE_S):
            await app.start()
            await app.warmed_up.wait()
        return app

    yield make
    for app in apps:
        await app.stop()


@pytest.fixture
async def engine_process(make_engine_process: Callable[..., Awaitable[App]]) -> App:
    return await make_engine_process()


async def test_a_stream_through_the_engine_process_is_byte_equal_and_the_text_side_answers_alike(
    one_process: App, engine_process: App
) -> None:
    link = engine_process.engine_client.link
    assert isinstance(link, ProcessLink) and link.pid not in (None, os.getpid())
    ws, hello = await open_client(engine_process.port)
    await ws.close()
    assert hello["server"].endswith("(chattts)") and hello["weights"] == "random"  # the info crossed
    for fmt in ("pcm16", "f32"):
        fields = {"text": TEXT, "seed": 11, "format": fmt}
        reference = await stream_payload(one_process.port, **fields)
        crossed = await stream_payload(engine_process.port, **fields)
        assert len(crossed) > 1000 and crossed == reference
    # The front end holds the text side only, and it answers as the engine in one process does.
    text, engine = link.text, one_process.engine_client
    assert isinstance(text, TextSide)
    assert [text.validate_voice(v) for v in VOICE_CHECKS] == [engine.validate_voice(v) for v in VOICE_CHECKS]
    assert [text.text_tokens(t) for t in TEXT_CHECKS] == [engine.text_tokens(t) for t in TEXT_CHECKS]
    with pytest.raises(RuntimeError, match="own process"):
        _ = engine_process.engine_client.engine  # no engine object in the front end


async def test_a_voice_from_a_recording_is_made_in_the_engine_process_and_spoken_byte_equal(
    make_model_app: Any, make_engine_process: Callable[..., Awaitable[App]], tmp_path: Path
) -> None:
    # The recording crosses as float32 (EncodeVoice), the DVAE's codes come back (VoiceEncoded),
    # and a stream in that voice carries them back inside its parameters.
    flags = ("--voice-max-seconds", "4", *DETERMINISTIC_SCHEDULE)
    one = await make_model_app("--voices-dir", str(tmp_path / "one"), *flags)
    two = await make_engine_process("--voices-dir", str(tmp_path / "two"), *flags)
    made = {}
    for app in (one, two):
        status, voice = await upload(app, form(encoded(recording(2.0)), transcript="这是一段参考录音。"))
        assert status == 200, voice
        stored = app.service.voices.get(voice["id"])
        assert stored is not None
        made[app] = (voice["id"], stored.sample.codes)
    codes_one, codes_two = made[one][1], made[two][1]
    assert codes_two.shape[0] == 4 and (codes_two == codes_one).all()
    spoken = [await stream_payload(app.port, text=TEXT, seed=3, voice=made[app][0]) for app in (one, two)]
    assert len(spoken[0]) > 1000 and spoken[1] == spoken[0]


@contextlib.asynccontextmanager
async def two_front_ends(model_dir: Path) -> AsyncIterator[Served]:
    """``serve --engine chattts --frontend-processes 2``, both children ready; all gone after."""
    port = free_port()
    voices = Path(tempfile.gettempdir()) / f"chattts-test-voices-{uuid.uuid4().hex}"
    proc = await spawn_server(
        *model_flags(model_dir),
        *("--port", str(port), "--frontend-processes", "2", "--voices-dir", str(voices)),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    served = Served(proc, port)
    try:
        await wait_ready(port, proc, timeout_s=DEADLINE_S)
        async with asyncio.timeout(DEADLINE_S):
            while len(children := served.front_ends()) < 2:
                await asyncio.sleep(0.05)
            for pid in children:
                while await ready_status(served, pid) != 200:
                    await asyncio.sleep(0.05)
        yield served
    finally:
        every = children_of(proc.pid) if proc.returncode is None else set()
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(DEADLINE_S):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        for pid in every:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_two_front_end_processes_each_stream_byte_equal(one_process: App, tiny_model_dir: Path) -> None:
    reference = await stream_payload(one_process.port, text=TEXT, seed=5)
    async with two_front_ends(tiny_model_dir) as served:
        children = served.front_ends()
        streamed: dict[int, bytes] = {}
        async with asyncio.timeout(DEADLINE_S):
            while set(streamed) != children:  # connect until the kernel has given one to each child
                ws, hello = await open_client(served.port)
                try:
                    on = holder(served, ws)
                    if on in streamed:
                        continue
                    assert hello["weights"] == "random"
                    await start(ws, id="s", text=TEXT, seed=5)
                    log = (await collect(ws, {"s"}))["s"]
                    assert log.done is not None and log.done["reason"] == "complete"
                    streamed[on] = log.payload
                finally:
                    await ws.close()
        assert len(reference) > 1000
        assert all(payload == reference for payload in streamed.values())
