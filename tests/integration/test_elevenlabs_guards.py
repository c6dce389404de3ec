"""Issue 42, findings 5 and 9: the ElevenLabs-only input rules.

The rules every front end shares (hostile JSON and numbers, floods, slow senders, clients
cut off mid-turn) are checked once for all of them by ``tests/integration/test_battery.py``.
Here are the rules only ElevenLabs has: its query numbers (``?seed=²``, 5000 digits),
``voice_settings`` of the wrong shape, and its invalid-message budget on both of its
WebSocket routes (close 1008, as ``/v1/stream``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import pytest

from server.app import App
from tests.integration.conftest import MakeApp

TIMEOUT_S = 30.0
NORMAL = "Still serving everyone."


def _eleven(app: App) -> str:
    return f"http://127.0.0.1:{app.http_port}/v1/text-to-speech/default"


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
