"""One voice list on every port, through real sockets and each port's own client, on the fake engine.

The fake engine's audio is a function of the voice it is handed (``expected_audio``), so a port
that maps a name to another voice (or not at all) sends other samples: each port's audio for a
name is checked byte for byte against the fake engine's audio for the voice the catalog says the
name is (``nova`` → ``seed:16``, a recording's id → its codes). The WebSocket (``start``), the
OpenAI endpoint (``/v1/audio/speech``), ElevenLabs' REST route and Wyoming's ``synthesize`` all
speak pcm16 at 24 kHz, with seed 0 (Wyoming's ``--wyoming-seed`` default).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from wyoming.error import Error
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeVoice

from server.app import App
from server.engine.fake import FAKE_VOICES
from server.engine_api import VoiceSample
from server.voices.catalog import OPENAI_VOICES
from tests.integration.conftest import MakeApp
from tests.integration.test_elevenlabs import base as elevenlabs_base
from tests.integration.test_http_speech import base_url
from tests.integration.test_refine import expected
from tests.integration.test_voices import encoded, form, recording, upload
from tests.integration.test_wyoming import client as wyoming_client
from tests.integration.test_wyoming import pcm, read, until_end
from tests.wsclient import collect, open_client, start

TEXT = "同一个名字，同一个声音。The same name is the same voice."
SEED = 0  # Wyoming's seed is the server's --wyoming-seed, 0 by default
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=30)
#: Names of every kind: the engine's, OpenAI's (each a seed, alloy the default), a seed pattern.
NAMES = ("default", "tenor", "alloy", "nova", "cedar", "seed:5")


# --- each port's way of asking for a voice: (audio, None) or (None, the error's message) -----------


async def websocket(app: App, voice: str) -> tuple[bytes | None, str | None]:
    ws, _ = await open_client(app.port)
    await start(ws, id="v", text=TEXT, voice=voice, seed=SEED, format="pcm16")
    log = (await collect(ws, {"v"}))["v"]
    await ws.close()
    if log.errors:
        assert [e["code"] for e in log.errors] == ["unsupported"], log.errors
        return None, str(log.errors[0]["message"])
    assert log.done is not None and log.done["reason"] == "complete"
    return log.payload, None


async def openai_http(app: App, voice: str) -> tuple[bytes | None, str | None]:
    body = {"model": "tts-1", "input": TEXT, "voice": voice, "response_format": "pcm", "seed": SEED}
    async with (
        aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session,
        session.post(f"{base_url(app)}/audio/speech", json=body) as response,
    ):
        if response.status == 200:
            return await response.read(), None
        error = (await response.json())["error"]
        assert (response.status, error["code"], error["param"]) == (400, "unsupported", "voice"), error
        return None, str(error["message"])


async def elevenlabs(app: App, voice: str) -> tuple[bytes | None, str | None]:
    url = f"{elevenlabs_base(app)}/{voice}?output_format=pcm_24000"
    async with (
        aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session,
        session.post(url, json={"text": TEXT, "seed": SEED}) as response,
    ):
        if response.status == 200:
            return await response.read(), None
        detail = (await response.json())["detail"]
        assert (response.status, detail["status"]) == (404, "voice_not_found"), detail
        return None, str(detail["message"])


async def wyoming(app: App, voice: str) -> tuple[bytes | None, str | None]:
    async with wyoming_client(app) as c:
        await c.write_event(Synthesize(TEXT, voice=SynthesizeVoice(voice)).event())
        events = await until_end(c)
    if Error.is_type(events[-1].type):
        error = Error.from_event(events[-1])
        assert error.code == "unsupported", error
        return None, error.text
    return pcm(events), None


Port = Callable[[App, str], Awaitable[tuple[bytes | None, str | None]]]
PORTS: dict[str, Port] = {
    "websocket": websocket,
    "openai": openai_http,
    "elevenlabs": elevenlabs,
    "wyoming": wyoming,
}


async def server_with_a_recording(make_app: MakeApp, tmp_path: Path) -> tuple[App, str, VoiceSample]:
    app: App = await make_app("--wyoming-port", "-1", "--voices-dir", str(tmp_path))
    status, voice = await upload(app, form(encoded(recording()), name="grandma"))
    assert status == 200, voice
    stored = app.service.voices.get(voice["id"])
    assert stored is not None
    return app, voice["id"], stored.sample


# --- the same name, the same voice ---------------------------------------------------------------


@pytest.mark.parametrize("port", PORTS)
async def test_a_voice_name_is_the_same_voice_on_every_port(
    make_app: MakeApp, tmp_path: Path, port: str
) -> None:
    """Each name's audio is the fake engine's audio for the voice the name is, on this port."""
    app, recorded, sample = await server_with_a_recording(make_app, tmp_path)
    speak = PORTS[port]
    for name in NAMES:
        audio, error = await speak(app, name)
        assert error is None, f"{port} refused {name!r}: {error}"
        want = expected(TEXT, SEED, voice=OPENAI_VOICES.get(name, name))
        assert audio == want, f"{port} spoke {name!r} as another voice"
    audio, error = await speak(app, recorded)
    assert error is None, error
    assert audio == expected(TEXT, SEED, voice=recorded, reference=sample), f"{port}: the recording"
    # The check can fail: two names that are two voices never give the same bytes.
    assert expected(TEXT, SEED, voice="seed:16") != expected(TEXT, SEED, voice="default")


@pytest.mark.parametrize("port", PORTS)
async def test_an_unknown_voice_is_refused_with_the_valid_names(
    make_app: MakeApp, tmp_path: Path, port: str
) -> None:
    app, recorded, _ = await server_with_a_recording(make_app, tmp_path)
    audio, message = await PORTS[port](app, "robot")
    assert audio is None and message is not None
    builtin = ", ".join([*FAKE_VOICES, *OPENAI_VOICES, "seed:<int>"])
    assert "robot" in message and f"{builtin}, or a voice from a recording: {recorded}" in message, message


# --- one list, wherever it is read -----------------------------------------------------------------


async def test_hello_the_http_voices_route_and_wyoming_info_list_the_same_names(
    make_app: MakeApp, tmp_path: Path
) -> None:
    app, recorded, _ = await server_with_a_recording(make_app, tmp_path)
    _, hello = await open_client(app.port)
    async with (
        aiohttp.ClientSession(timeout=HTTP_TIMEOUT) as session,
        session.get(f"{base_url(app)}/audio/voices") as response,
    ):
        assert response.status == 200
        listed: list[dict[str, Any]] = (await response.json())["data"]
    async with wyoming_client(app) as c:
        await c.write_event(Describe().event())
        event = await read(c)
    assert event is not None
    [tts] = Info.from_event(event).tts

    names = [*FAKE_VOICES, *OPENAI_VOICES, recorded]
    assert hello["voices"] == names
    assert [entry["id"] for entry in listed] == names
    assert [voice.name for voice in tts.voices] == names
    # What each name speaks with, as the HTTP route says it: the same mapping the audio follows.
    assert {e["id"]: e["voice"] for e in listed} == {
        **{v: v for v in FAKE_VOICES},
        **OPENAI_VOICES,
        recorded: recorded,
    }
    assert {v.name: v.description for v in tts.voices}[recorded] == "grandma (from a recording)"
