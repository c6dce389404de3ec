"""Issue 42, findings 5 and 9: hostile JSON and numbers get a clear error on every front end.

Every front end decodes through ``server/frontends/messages.py`` (nesting, then the number
bound, then msgspec), so the battery below is parametrized over all of them: the WebSocket,
the OpenAI HTTP body, the ElevenLabs REST body and WebSocket, and Wyoming. Each hostile value
gets that front end's own clear error (never a 500, a dropped socket or a traceback), and the
same front end then still speaks to a normal client. A new front end joins by adding itself
to ``FRONT_ENDS``. Then the ElevenLabs-only rules: its query numbers (``?seed=²``, 5000
digits), ``voice_settings`` of the wrong shape, and its invalid-message budget (close 1008,
as ``/v1/stream``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from server.app import App
from tests.integration.conftest import MakeApp
from tests.integration.test_hostile_input import assert_wyoming_serves, wyoming_answer
from tests.integration.test_wyoming import WYOMING
from tests.wsclient import open_client, recv_json, stream_payload

TIMEOUT_S = 30.0
NORMAL = "Still serving everyone."

#: (what, the hostile JSON value, words the error must have)
HOSTILE = [
    ("5000 levels deep", "[" * 5000 + "]" * 5000, "--max-json-depth"),
    ("a float that overflows", "1e400", "out of range"),
    ("a negative float that overflows", "-1e400", "out of range"),
    ("a 5000-digit integer", "9" * 5000, "out of range"),
    ("a 25-digit integer", "1" + "0" * 24, "out of range"),
    ("an exponent of 30 digits", "1e" + "0" * 29 + "1", "out of range"),
]


def _eleven(app: App) -> str:
    return f"http://127.0.0.1:{app.http_port}/v1/text-to-speech/default"


async def _websocket(app: App, value: str) -> str:
    """``/v1/stream``: the value as a ``start``'s speed; then the same connection speaks."""
    ws, _ = await open_client(app.port)
    try:
        await ws.send('{"type": "start", "id": "h", "text": "Hi.", "speed": ' + value + "}")
        error = await recv_json(ws)
        assert error["type"] == "error" and error["code"] == "bad_request", error
        return str(error["message"])
    finally:
        await ws.close()


async def _websocket_serves(app: App) -> None:
    assert await stream_payload(app.port, text=NORMAL, seed=1)


async def _openai(app: App, value: str) -> str:
    url = f"http://127.0.0.1:{app.http_port}/v1/audio/speech"
    body = '{"input": "Hi.", "response_format": "pcm", "speed": ' + value + "}"
    async with aiohttp.ClientSession() as s, s.post(url, data=body) as response:
        assert response.status == 400, await response.text()
        return str((await response.json())["error"]["message"])


async def _openai_serves(app: App) -> None:
    url = f"http://127.0.0.1:{app.http_port}/v1/audio/speech"
    async with (
        aiohttp.ClientSession() as s,
        s.post(url, json={"input": NORMAL, "response_format": "pcm"}) as r,
    ):
        assert r.status == 200 and await r.read()


async def _eleven_rest(app: App, value: str) -> str:
    body = '{"text": "Hi.", "voice_settings": {"speed": ' + value + "}}"
    async with aiohttp.ClientSession() as s, s.post(_eleven(app), data=body) as response:
        assert response.status == 400, await response.text()
        return str((await response.json())["detail"]["message"])


async def _eleven_rest_serves(app: App) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(_eleven(app) + "?output_format=pcm_24000", json={"text": NORMAL}) as response,
    ):
        assert response.status == 200 and await response.read()


async def _eleven_socket(app: App, value: str) -> str:
    """The ElevenLabs WebSocket: the value in a context's voice_settings; then the same socket speaks."""
    url = _eleven(app).replace("http", "ws") + "/multi-stream-input?output_format=pcm_24000"
    async with aiohttp.ClientSession() as s, s.ws_connect(url) as ws:
        await ws.send_str('{"text": " ", "context_id": "h", "voice_settings": {"speed": ' + value + "}}")
        async with asyncio.timeout(TIMEOUT_S):
            error = json.loads((await ws.receive()).data)
        assert error.get("error") == "bad_request", error
        await _speak_on(ws, "n")
        return str(error["message"])


async def _speak_on(ws: aiohttp.ClientWebSocketResponse, context: str) -> None:
    """One normal turn on an open ElevenLabs socket: audio comes, then ``isFinal``."""
    for message in (
        {"text": " ", "context_id": context},
        {"text": NORMAL + " ", "context_id": context},
        {"context_id": context, "flush": True},
        {"context_id": context, "close_context": True},
    ):
        await ws.send_json(message)
    audio = False
    async with asyncio.timeout(TIMEOUT_S):
        while True:
            message = await ws.receive()
            assert message.type == aiohttp.WSMsgType.TEXT, message
            got = json.loads(message.data)
            if got.get("contextId") != context:
                continue
            audio = audio or bool(got.get("audio"))
            if got.get("isFinal") is True:
                break
    assert audio


async def _eleven_socket_serves(app: App) -> None:
    url = _eleven(app).replace("http", "ws") + "/multi-stream-input?output_format=pcm_24000"
    async with aiohttp.ClientSession() as s, s.ws_connect(url) as ws:
        await _speak_on(ws, "ok")


async def _wyoming(app: App, value: str) -> str:
    raw = ('{"type": "synthesize", "data": {"text": "Hi.", "speed": ' + value + "}}\n").encode()
    answer = await wyoming_answer(app, raw)
    assert answer["code"] == "bad_request", answer
    return str(answer["text"])


#: Every front end that decodes a client's JSON: how to send it a value, how a normal client fares.
FRONT_ENDS: dict[str, tuple[Callable[[App, str], Awaitable[str]], Callable[[App], Awaitable[None]]]] = {
    "websocket": (_websocket, _websocket_serves),
    "openai": (_openai, _openai_serves),
    "elevenlabs-rest": (_eleven_rest, _eleven_rest_serves),
    "elevenlabs-websocket": (_eleven_socket, _eleven_socket_serves),
    "wyoming": (_wyoming, assert_wyoming_serves),
}


@pytest.mark.parametrize("front_end", sorted(FRONT_ENDS))
async def test_hostile_json_and_numbers_get_a_clear_error_on_every_front_end(
    make_app: MakeApp, front_end: str
) -> None:
    app = await make_app(*WYOMING)
    refuse, serves = FRONT_ENDS[front_end]
    for what, value, words in HOSTILE:
        message = await refuse(app, value)
        assert words in message, f"{front_end}, {what}: {message}"
        assert len(message) < 400, f"{front_end}, {what}: the error quotes the input: {message[:100]}…"
    await serves(app)


# --- the ElevenLabs query numbers and voice_settings --------------------------------------------


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("seed=%C2%B2", "seed"),  # '²': str.isdigit() says yes, int() says no
        ("seed=" + "9" * 5000, "seed"),
        ("seed=-1", "seed"),
        ("seed=9223372036854775808", "seed"),  # 2^63
        ("inactivity_timeout=%C2%B2", "inactivity_timeout"),
        ("inactivity_timeout=abc", "inactivity_timeout"),
        ("output_format=pcm_" + "9" * 5000, "output_format"),
        ("output_format=mp3_24000_" + "9" * 5000, "output_format"),
    ],
)
async def test_bad_query_numbers_are_a_400_naming_the_parameter(app: App, query: str, named: str) -> None:
    url = _eleven(app) + "/multi-stream-input?" + query
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await s.ws_connect(url.replace("http", "ws"))
        assert refused.value.status == 400
        async with s.get(url) as response:  # the same refusal, read
            body = await response.json()
        code = "invalid_output_format" if named == "output_format" else "bad_request"
        assert response.status == 400 and body["detail"]["status"] == code, body
        assert named in body["detail"]["message"] and len(body["detail"]["message"]) < 400


async def test_a_huge_inactivity_timeout_is_brought_within_its_range(app: App) -> None:
    url = _eleven(app).replace("http", "ws") + "/multi-stream-input?inactivity_timeout=" + "9" * 5000
    async with aiohttp.ClientSession() as s, s.ws_connect(url) as ws:
        await _speak_on(ws, "a")


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ('"fast"', "$.voice_settings"),
        ('{"speed": "1.0"}', "$.voice_settings.speed"),
        ('{"speed": true}', "$.voice_settings.speed"),
        ('{"speed": 9.5}', "$.voice_settings.speed"),
        ('{"stability": [1]}', "$.voice_settings.stability"),
    ],
)
async def test_voice_settings_of_the_wrong_shape_are_refused_on_rest_and_websocket(
    app: App, settings: str, field: str
) -> None:
    async with aiohttp.ClientSession() as s:
        body = '{"text": "Hi.", "voice_settings": ' + settings + "}"
        async with s.post(_eleven(app), data=body) as response:
            answer = await response.json()
        assert response.status == 400 and field in answer["detail"]["message"], answer
        url = _eleven(app).replace("http", "ws") + "/multi-stream-input"
        async with s.ws_connect(url) as ws:
            await ws.send_str('{"text": " ", "context_id": "v", "voice_settings": ' + settings + "}")
            async with asyncio.timeout(TIMEOUT_S):
                error = json.loads((await ws.receive()).data)
                final = json.loads((await ws.receive()).data)
            assert error["error"] == "bad_request" and field in error["message"], error
            assert final == {"isFinal": True, "contextId": "v"}  # the context refused at its start
            await _speak_on(ws, "after")


# --- finding 9: the ElevenLabs WebSocket's invalid-message budget -----------------------------


@pytest.mark.parametrize("route", ["multi-stream-input", "stream-input"])
async def test_a_flood_of_invalid_messages_closes_the_elevenlabs_socket_with_1008(
    make_app: MakeApp, route: str
) -> None:
    app = await make_app("--invalid-messages-per-s", "5")
    url = _eleven(app).replace("http", "ws") + f"/{route}"
    sent, errors = 400, 0
    async with aiohttp.ClientSession() as s, s.ws_connect(url) as ws:
        with contextlib.suppress(ConnectionError):
            for n in range(sent):
                await ws.send_str("[]" if n % 2 else '{"text": 5}')  # no object; text no string
        async with asyncio.timeout(TIMEOUT_S):
            while (message := await ws.receive()).type == aiohttp.WSMsgType.TEXT:
                got: dict[str, Any] = json.loads(message.data)
                errors += "error" in got
        assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), message
        assert ws.close_code == 1008, (ws.close_code, errors)
    assert 5 <= errors < sent, errors  # the budget, then the close: not one answer per message
    assert 'chattts_errors_total{code="too_many_invalid"} 1.0' in app.metrics.render().decode()
