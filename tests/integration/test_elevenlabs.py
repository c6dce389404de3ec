"""The ElevenLabs front end's rules, with a plain aiohttp client: access, refusals, contexts, drain."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from server.app import App
from server.engine.fake import FAKE_VOICES
from server.voices.catalog import OPENAI_VOICES
from tests.integration.conftest import fake_engine, wait_until
from tests.wsclient import stream_payload

TEXT = "The first sentence is right here. The second sentence ends it all."
WS_TIMEOUT = 30.0


def base(app: App) -> str:
    return f"http://127.0.0.1:{app.http_port}/v1/text-to-speech"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def messages_until_final(
    ws: aiohttp.ClientWebSocketResponse, context: str | None
) -> list[dict[str, Any]]:
    """Every message until ``isFinal`` for ``context`` (None: any), within the deadline."""
    got: list[dict[str, Any]] = []
    async with asyncio.timeout(WS_TIMEOUT):
        while True:
            message = await ws.receive()
            assert message.type == aiohttp.WSMsgType.TEXT, message
            got.append(json.loads(message.data))
            if got[-1].get("isFinal") is True and (context is None or got[-1].get("contextId") == context):
                return got


def audio_of(messages: list[dict[str, Any]]) -> bytes:
    return b"".join(base64.b64decode(m["audio"]) for m in messages if m.get("audio"))


async def test_stream_input_speaks_one_context_then_closes(
    make_app: Any, session: aiohttp.ClientSession
) -> None:
    app = await make_app("--elevenlabs-seed", "3")
    url = base(app).replace("http", "ws") + "/default/stream-input?model_id=x&output_format=pcm_16000"
    async with session.ws_connect(url) as ws:
        await ws.send_json({"text": " ", "voice_settings": {"stability": 0.5}})
        await ws.send_json({"text": TEXT + " "})
        await ws.send_json({"text": ""})  # stream-input: the end of the text
        got = await messages_until_final(ws, None)
        async with asyncio.timeout(WS_TIMEOUT):
            closed = await ws.receive()
    assert closed.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    assert all("contextId" not in m for m in got)  # stream-input has no contexts
    assert audio_of(got) == await stream_payload(app.port, text=TEXT, seed=3, sample_rate=16_000)
    chars = [c for m in got if m.get("alignment") for c in m["alignment"]["chars"]]
    assert "".join(chars).split() == TEXT.replace(".", "").split()


async def test_multi_stream_input_keeps_contexts_apart_and_ignores_keep_alives(
    make_app: Any, session: aiohttp.ClientSession
) -> None:
    app = await make_app("--elevenlabs-seed", "3")
    url = (
        base(app).replace("http", "ws")
        + "/default/multi-stream-input?auto_mode=true&sync_alignment=true&output_format=pcm_24000"
    )
    async with session.ws_connect(url) as ws:
        await ws.send_json({"text": ""})  # keep-alives, with and without a context: nothing happens
        await ws.send_json({"text": " ", "context_id": "a"})
        await ws.send_json({"text": "", "context_id": "a"})
        await ws.send_json({"text": " ", "context_id": "b"})
        for sentence in ("The first sentence is right here.", "The second sentence ends it all."):
            await ws.send_json({"text": sentence, "context_id": "a"})  # no trailing space (pipecat)
        await ws.send_json({"text": "Another context speaks.", "context_id": "b"})
        for context in ("a", "b"):
            await ws.send_json({"context_id": context, "flush": True})
            await ws.send_json({"context_id": context, "close_context": True})
        got = await messages_until_final(ws, "a")
        got += (
            await messages_until_final(ws, "b")
            if not any(m.get("isFinal") and m.get("contextId") == "b" for m in got)
            else []
        )
    by_context = {c: [m for m in got if m.get("contextId") == c] for c in ("a", "b")}
    assert all("contextId" in m for m in got)  # pipecat drops audio without it
    assert audio_of(by_context["a"]) == await stream_payload(app.port, text=TEXT, seed=3)
    assert audio_of(by_context["b"]) == await stream_payload(app.port, text="Another context speaks.", seed=3)
    # normalizedAlignment is on the context's clock; alignment restarts with each segment.
    normalized = [m["normalizedAlignment"] for m in by_context["a"] if m.get("normalizedAlignment")]
    starts = [t for a in normalized for t in a["charStartTimesMs"]]
    assert starts == sorted(starts) and len(normalized) == 2
    relative = [m["alignment"] for m in by_context["a"] if m.get("alignment")]
    spans = [a["charStartTimesMs"][-1] + a["charDurationsMs"][-1] for a in relative]
    total_ms = len(audio_of(by_context["a"])) / 2 / 24
    assert abs(sum(spans) - total_ms) <= 2  # the spans tile the audio (pipecat's clock)


async def test_close_context_without_a_flush_cancels_it(
    make_app: Any, session: aiohttp.ClientSession
) -> None:
    app = await make_app("--fake-step-ms", "200", "--cache-bytes", "0")
    engine = fake_engine(app)
    url = base(app).replace("http", "ws") + "/default/multi-stream-input?auto_mode=true"
    async with session.ws_connect(url) as ws:
        await ws.send_json({"text": " ", "context_id": "c"})
        await ws.send_json(
            {"text": "A long sentence that keeps the engine busy for a while. " * 3, "context_id": "c"}
        )
        await wait_until(lambda: engine.live_sequences > 0)
        await ws.send_json({"context_id": "c", "close_context": True})  # an interruption
        got = await messages_until_final(ws, "c")
    await wait_until(lambda: engine.live_sequences == 0)
    assert got[-1] == {"isFinal": True, "contextId": "c"}
    await wait_until(lambda: 'chattts_streams_total{reason="cancelled"} 1.0' in app.metrics.render().decode())


async def test_refusals_in_elevenlabs_shape(app: App, session: aiohttp.ClientSession) -> None:
    ws_base = base(app).replace("http", "ws")
    for url, status, code in [
        (f"{ws_base}/nobody/multi-stream-input", 404, "voice_not_found"),
        (f"{ws_base}/default/multi-stream-input?output_format=mp3_44100_128", 400, "invalid_output_format"),
        (f"{ws_base}/default/stream-input?output_format=alaw_8000", 400, "invalid_output_format"),
    ]:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await session.ws_connect(url)
        assert refused.value.status == status, url
        async with session.get(url.replace("ws", "http", 1)) as response:  # the same refusal, read
            assert response.status == status and (await response.json())["detail"]["status"] == code
    async with session.post(f"{base(app)}/nobody", json={"text": "hi"}) as response:
        assert response.status == 404
        body = await response.json()
        assert body == {
            "detail": {
                "status": "voice_not_found",
                "message": "A voice with the voice_id nobody was not found. Voices here: "
                + ", ".join([*FAKE_VOICES, *OPENAI_VOICES, "seed:<int>"])
                + ".",
            }
        }
    async with session.post(f"{base(app)}/default", json={"text": ""}) as response:
        assert response.status == 400 and (await response.json())["detail"]["status"] == "invalid_request"
    async with session.post(f"{base(app)}/default?output_format=pcm_44100", json={"text": "hi"}) as response:
        detail = (await response.json())["detail"]
        assert response.status == 400 and "pcm_24000" in detail["message"]


async def test_rest_formats_voices_and_speed(app: App, session: aiohttp.ClientSession) -> None:
    cases = [
        ("pcm_24000", "audio/pcm", {}),
        ("ulaw_8000", "audio/basic", {"format": "mulaw", "sample_rate": 8000}),
    ]
    for name, content_type, ours in cases:
        body = {"text": TEXT, "seed": 5, "voice_settings": {"speed": 1.5, "stability": 0.1}, "model_id": "m"}
        async with session.post(f"{base(app)}/alloy/stream?output_format={name}", json=body) as response:
            assert response.status == 200 and response.content_type == content_type
            audio = await response.read()
        assert audio == await stream_payload(app.port, text=TEXT, seed=5, voice="default", speed=1.5, **ours)
    async with session.post(f"{base(app)}/default", json={"text": TEXT}) as response:
        assert response.content_type == "audio/mpeg"  # no output_format: MP3 at 24 kHz


async def test_rest_with_timestamps_lines(app: App, session: aiohttp.ClientSession) -> None:
    url = f"{base(app)}/default/stream/with-timestamps?output_format=pcm_24000"
    async with session.post(url, json={"text": TEXT, "seed": 2}) as response:
        lines = [json.loads(line) async for line in response.content if line.strip()]
    audio = b"".join(base64.b64decode(line["audio_base64"]) for line in lines)
    assert audio == await stream_payload(app.port, text=TEXT, seed=2)
    aligned = [line["alignment"] for line in lines if line["alignment"]]
    chars = "".join(c for a in aligned for c in a["characters"])
    assert chars.split() == TEXT.replace(".", "").split()
    ends = [t for a in aligned for t in a["character_end_times_seconds"]]
    assert ends == sorted(ends) and abs(ends[-1] - len(audio) / 2 / 24_000) < 0.002


async def test_xi_api_key_in_the_header_or_the_first_message(
    make_app: Any, session: aiohttp.ClientSession
) -> None:
    app = await make_app("--api-keys", "sekret")
    url = base(app)
    async with session.post(
        f"{url}/default", json={"text": "hi"}, headers={"xi-api-key": "wrong"}
    ) as response:
        assert response.status == 401 and (await response.json())["detail"]["status"] == "invalid_api_key"
    async with session.post(
        f"{url}/default", json={"text": "hi"}, headers={"xi-api-key": "sekret"}
    ) as response:
        assert response.status == 200 and await response.read()
    ws_url = url.replace("http", "ws") + "/default/stream-input?output_format=pcm_24000"
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await session.ws_connect(ws_url, headers={"xi-api-key": "wrong"})
    assert refused.value.status == 401
    async with session.ws_connect(ws_url) as ws:  # no key yet: the first message must carry it
        await ws.send_json({"text": " ", "xi_api_key": "wrong"})
        async with asyncio.timeout(WS_TIMEOUT):
            closed = await ws.receive()
        assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 1008
    async with session.ws_connect(ws_url) as ws:
        await ws.send_json({"text": " ", "xi_api_key": "sekret"})
        await ws.send_json({"text": "Hello there.", "flush": True})
        await ws.send_json({"text": ""})
        got = await messages_until_final(ws, None)
    assert audio_of(got)


async def test_bad_messages_are_answered_and_the_socket_stays(
    app: App, session: aiohttp.ClientSession
) -> None:
    url = base(app).replace("http", "ws") + "/default/multi-stream-input"
    async with session.ws_connect(url) as ws:
        await ws.send_str("{not json")
        await ws.send_json([1, 2])
        await ws.send_json({"text": 5, "context_id": "x"})
        await ws.send_json({"text": "[foo] is no tag", "context_id": "y"})
        errors = []
        async with asyncio.timeout(WS_TIMEOUT):
            while len(errors) < 4:  # a context refused at its start also gets its isFinal
                message = json.loads((await ws.receive()).data)
                if "error" in message:
                    errors.append(message)
        assert [e["error"] for e in errors[:3]] == ["bad_request"] * 3
        assert errors[3]["error"] == "bad_request" and errors[3]["contextId"] == "y"
        # Still serving: a context speaks.
        await ws.send_json({"text": "Still here.", "context_id": "z", "flush": True})
        await ws.send_json({"context_id": "z", "flush": True})
        await ws.send_json({"context_id": "z", "close_context": True})
        got = await messages_until_final(ws, "z")
    assert audio_of(got)


async def test_a_context_whose_first_text_is_refused_still_ends_with_its_final(
    app: App, session: aiohttp.ClientSession
) -> None:
    # More than --max-pending-chars (1000) without a sentence end, in the message that opens the
    # context: refused, but the context was opened, so its isFinal must follow (its pump was lost
    # with the refusal, and the client waited for ever on a stream nobody sent).
    url = base(app).replace("http", "ws") + "/default/multi-stream-input"
    async with session.ws_connect(url) as ws:
        await ws.send_json({"text": "word " * 220, "context_id": "big", "flush": True})
        got = await messages_until_final(ws, "big")
        assert [m.get("error") for m in got if "error" in m] == ["text_too_long"]
        await ws.send_json({"text": "Still here.", "context_id": "z"})
        await ws.send_json({"context_id": "z", "flush": True})  # a bare flush: the end of the turn
        await ws.send_json({"context_id": "z", "close_context": True})
        assert audio_of(await messages_until_final(ws, "z"))


async def test_close_context_after_words_sent_with_a_flush_is_an_interruption(
    app: App, session: aiohttp.ClientSession
) -> None:
    # LiveKit's auto mode sends every sentence with "flush": true and closes the context right
    # after one when the agent is interrupted: cancelled at once. A bare flush before the close
    # (pipecat's end of turn, LiveKit's end of input) lets the text finish.
    engine = fake_engine(app)
    url = base(app).replace("http", "ws") + "/default/multi-stream-input?auto_mode=true"
    long_text = "This sentence is one of many in a long answer. " * 12
    async with session.ws_connect(url) as ws:
        await ws.send_json({"text": long_text, "context_id": "cut", "flush": True})
        await ws.send_json({"context_id": "cut", "close_context": True})
        await messages_until_final(ws, "cut")
        await ws.send_json({"text": "Spoken to its end.", "context_id": "kept", "flush": True})
        await ws.send_json({"context_id": "kept", "flush": True})
        await ws.send_json({"context_id": "kept", "close_context": True})
        kept = await messages_until_final(ws, "kept")
    assert audio_of(kept)
    await wait_until(lambda: 'chattts_streams_total{reason="cancelled"} 1.0' in app.metrics.render().decode())
    await wait_until(lambda: engine.live_sequences == 0)


async def test_too_many_contexts_and_rate_limits(make_app: Any, session: aiohttp.ClientSession) -> None:
    app = await make_app("--max-streams", "1", "--fake-step-ms", "50")
    url = base(app).replace("http", "ws") + "/default/multi-stream-input"
    async with session.ws_connect(url) as ws:
        await ws.send_json({"text": "One sentence here.", "context_id": "a"})
        await ws.send_json({"text": "Another one.", "context_id": "b"})
        got = await messages_until_final(ws, "b")
        assert got[-2]["error"] == "bad_request" and "at most 1 context(s)" in got[-2]["message"]
        await ws.send_json({"context_id": "a", "close_context": True})
    app2 = await make_app("--rate-limit-per-min", "1", "--rate-limit-burst", "1")
    url2 = base(app2).replace("http", "ws") + "/default/multi-stream-input?auto_mode=true"
    async with session.ws_connect(url2) as ws:
        await ws.send_json({"text": "First.", "context_id": "a"})
        await ws.send_json({"text": "Second.", "context_id": "b"})
        got = await messages_until_final(ws, "b")
        if not any(m.get("isFinal") is True and m.get("contextId") == "a" for m in got):
            got += await messages_until_final(ws, "a")
    assert [m["error"] for m in got if m.get("contextId") == "b" and "error" in m] == ["rate_limited"]
    # The first context spent the one token and plays: opening a context costs one token, not two.
    assert not [m for m in got if m.get("contextId") == "a" and "error" in m]
    assert any(m.get("audio") for m in got if m.get("contextId") == "a")


async def test_a_drain_closes_idle_sockets_with_1012(make_app: Any, session: aiohttp.ClientSession) -> None:
    app = await make_app()
    url = base(app).replace("http", "ws") + "/default/multi-stream-input"
    ws = await session.ws_connect(url)
    drain = asyncio.create_task(app.drain())
    try:
        async with asyncio.timeout(WS_TIMEOUT):
            closed = await ws.receive()
        assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 1012
        await drain
    finally:
        await ws.close()
        drain.cancel()
        await asyncio.gather(drain, return_exceptions=True)
