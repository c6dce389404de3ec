"""The OpenAI-compatible HTTP speech endpoint, over real loopback sockets, against the fake engine."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import wave
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import openai
import pytest
import soundfile
from openai import AsyncOpenAI

from server.app import App
from server.audio.pcm import to_pcm16
from server.engine.fake import FAIL_MARKER, expected_audio
from server.engine_api import SequenceRequest, SynthesisParams
from server.errors import StartupError
from server.frontends.http.files import wav_header
from server.text.segments import split_segments
from server.voices.catalog import OPENAI_VOICES
from tests.integration.conftest import fake_engine, fake_settings, wait_until
from tests.serverproc import free_port
from tests.wsclient import open_client, stream_payload

TEXT = "你好，欢迎使用语音服务。今天天气很好！This is a streaming test. Does it work? 最后一句话。"
LONG_TEXT = "This long sentence keeps the fake engine busy for many blocks in a row. " * 6


def base_url(app: App) -> str:
    assert app.http_port is not None
    return f"http://127.0.0.1:{app.http_port}/v1"


def client(app: App) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url(app), api_key="x", max_retries=0)


async def ws_payload(app: App, **fields: Any) -> bytes:
    """The concatenated frame payloads of the same request over the WebSocket."""
    return await stream_payload(app.port, **fields)


async def post(app: App, body: Any, *, raw: bytes | None = None) -> tuple[int, dict[str, str], Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{base_url(app)}/audio/speech",
            data=raw if raw is not None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        ) as resp,
    ):
        payload = await resp.read()
        return resp.status, dict(resp.headers), json.loads(payload) if payload[:1] == b"{" else payload


# --- 1. the official client gets the WebSocket's bytes ---------------------------------


@pytest.mark.parametrize(("fmt", "voice"), [("pcm", "alloy"), ("wav", "echo")])
async def test_openai_client_streams_the_websocket_bytes(
    app: App, tmp_path: Path, fmt: str, voice: str
) -> None:
    out = tmp_path / f"speech.{fmt}"
    async with (
        client(app) as oai,
        oai.audio.speech.with_streaming_response.create(
            model="tts-1", voice=voice, input=TEXT, response_format=fmt, extra_body={"seed": 7}
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"] == ("audio/pcm" if fmt == "pcm" else "audio/wav")
        assert response.headers.get("transfer-encoding") == "chunked"
        await response.stream_to_file(out)
    got = out.read_bytes()

    reference = await ws_payload(app, text=TEXT, seed=7, voice=OPENAI_VOICES[voice], format="pcm16")
    assert len(reference) > 48_000  # a real multi-second stream
    if fmt == "pcm":
        assert got == reference
        return
    assert got == wav_header(24_000) + reference
    # Readers cope with the unknown-length sizes: the wave module and libsndfile.
    with wave.open(io.BytesIO(got)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24_000, 1, 2)
        assert w.readframes(w.getnframes()) == reference
    samples, rate = soundfile.read(io.BytesIO(got), dtype="int16")
    assert rate == 24_000 and samples.tobytes() == np.frombuffer(reference, "<i2").tobytes()


async def test_speed_outside_ours_is_clamped_and_voice_objects_work(app: App) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": "chattts", "input": "Fast words.", "voice": {"id": "seed:5"}, "speed": 3.5}
        body |= {"response_format": "pcm", "seed": 3}
        async with session.post(f"{base_url(app)}/audio/speech", json=body) as resp:
            assert resp.status == 200
            got = await resp.read()
    assert got == await ws_payload(app, text="Fast words.", seed=3, voice="seed:5", speed=2.0)


async def test_opus_is_an_ogg_opus_stream(app: App) -> None:
    status, headers, body = await post(
        app, {"model": "tts-1", "input": TEXT, "voice": "nova", "response_format": "opus"}
    )
    assert status == 200 and headers["Content-Type"] == "audio/ogg; codecs=opus"
    assert body[:4] == b"OggS" and b"OpusHead" in body[:64] and b"OpusTags" in body


# --- 2. audio streams while it is generated ----------------------------------------------


async def test_first_bytes_arrive_before_generation_finishes(make_app: Any) -> None:
    app = await make_app("--fake-step-ms", "30")
    engine = fake_engine(app)
    segments = split_segments(TEXT)
    assert len(segments) == 5
    await wait_until(lambda: app.ready and engine.live_sequences == 0)  # warm-up done: the log is ours
    before = len(engine.events)
    async with (
        client(app) as oai,
        oai.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=TEXT, response_format="pcm", extra_body={"seed": 7}
        ) as response,
    ):
        chunks = response.iter_bytes()
        first = await anext(chunks)
        # The engine log at the moment the first bytes are in the client's hands.
        finished = [seq for kind, seq in list(engine.events)[before:] if kind == "finish"]
        steps = len(engine.steps)
        assert first
        assert len(finished) < len(segments)
        assert engine.live_sequences > 0
        rest = b"".join([chunk async for chunk in chunks])
    assert len([1 for kind, _ in list(engine.events)[before:] if kind == "finish"]) == len(segments)
    assert len(engine.steps) > steps  # generation went on after the first bytes
    assert first + rest == await ws_payload(app, text=TEXT, seed=7, voice="default")


# --- 3. errors, overload, disconnect, drain --------------------------------------------------


def assert_openai_error(
    status: int, body: Any, code: str, param: str | None, expected_status: int = 400
) -> None:
    assert status == expected_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code and body["error"]["param"] == param
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["type"] == (
        "invalid_request_error" if expected_status == 400 else body["error"]["type"]
    )


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"model": "tts-1", "voice": "alloy"}, "bad_request", "input"),
        ({"model": "tts-1", "input": 5, "voice": "alloy"}, "bad_request", "input"),
        ({"model": "tts-1", "input": "Hi.", "speed": "fast"}, "bad_request", "speed"),
        ({"model": "tts-1", "input": "Hi.", "seed": -1}, "bad_request", "seed"),
        ({"model": "tts-1", "input": "Hi.", "speed": 5.0}, "bad_request", "speed"),
        ({"model": "tts-1", "input": "Hi.", "response_format": "aac"}, "unsupported", "response_format"),
        ({"model": "tts-1", "input": "Hi.", "response_format": "ogg"}, "unsupported", "response_format"),
        ({"model": "tts-1", "input": "Hi.", "stream_format": "sse"}, "unsupported", "stream_format"),
        ({"model": "tts-1", "input": "Hi.", "voice": "nobody"}, "unsupported", "voice"),
        ({"model": "tts-1", "input": "x" * 2001}, "text_too_long", None),
        ({"model": "tts-1", "input": "…!?"}, "bad_request", None),
        ([1, 2], "bad_request", None),
    ],
)
async def test_bad_bodies_get_400_in_openai_shape(app: App, body: Any, code: str, param: str | None) -> None:
    status, _, answer = await post(app, body)
    assert_openai_error(status, answer, code, param)
    if param == "response_format":
        assert "'pcm', 'wav', 'opus'" in answer["error"]["message"]


async def test_malformed_json_and_unknown_routes(app: App) -> None:
    status, _, answer = await post(app, None, raw=b'{"input": "Hi.",')
    assert_openai_error(status, answer, "bad_request", None)
    assert "malformed JSON" in answer["error"]["message"]
    status, _, answer = await post(app, None, raw=b"x" * 70_000)
    assert_openai_error(status, answer, "bad_request", None, expected_status=413)
    async with aiohttp.ClientSession() as session, session.get(f"{base_url(app)}/nope") as resp:
        assert_openai_error(resp.status, await resp.json(), "bad_request", None, expected_status=404)
    # The official client turns the error into an exception carrying our code.
    async with client(app) as oai:
        with pytest.raises(openai.BadRequestError) as refused:
            await oai.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", response_format="aac")
    assert refused.value.code == "unsupported" and refused.value.param == "response_format"


async def test_overload_answers_429_with_retry_after(make_app: Any) -> None:
    app = await make_app("--max-queue", "0")  # every submission finds the queue full
    status, headers, answer = await post(app, {"model": "tts-1", "input": "Hello.", "voice": "alloy"})
    assert_openai_error(status, answer, "overloaded", None, expected_status=429)
    assert answer["error"]["type"] == "rate_limit_error"
    assert int(headers["Retry-After"]) >= 1
    assert app.active_streams == 0


async def test_draining_answers_503(app: App) -> None:
    app.service.draining = True
    status, _, answer = await post(app, {"model": "tts-1", "input": "Hello.", "voice": "alloy"})
    assert_openai_error(status, answer, "shutting_down", None, expected_status=503)
    app.service.draining = False


async def test_disconnect_mid_response_frees_engine_work(make_app: Any) -> None:
    app = await make_app("--fake-step-ms", "30")
    engine = fake_engine(app)
    body = {"model": "tts-1", "input": LONG_TEXT, "voice": "alloy", "response_format": "pcm", "seed": 1}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{base_url(app)}/audio/speech", json=body)
        assert resp.status == 200
        assert await resp.content.readany()
        assert engine.live_sequences > 0 and app.active_streams == 1
        resp.close()  # drops the connection mid-body
    await wait_until(lambda: engine.live_sequences == 0)
    await wait_until(lambda: app.active_streams == 0 and len(app.service.registry) == 0)
    assert any(kind == "drop" for kind, _ in engine.events)
    assert 'chattts_streams_total{reason="cancelled"} 1.0' in app.metrics.render().decode()


# --- discovery ---------------------------------------------------------------------


async def test_models_and_voices(app: App) -> None:
    async with client(app) as oai:
        models = [m.id async for m in oai.models.list()]
    assert "chattts" in models and "tts-1" in models
    async with aiohttp.ClientSession() as session, session.get(f"{base_url(app)}/audio/voices") as resp:
        assert resp.status == 200
        voices = await resp.json()
    by_id = {v["id"]: v["voice"] for v in voices["data"]}
    assert by_id["alloy"] == "default" and by_id["shimmer"].startswith("seed:")
    assert {"default", "alto", "tenor"} <= set(by_id)
    assert voices["formats"] == ["pcm", "wav", "opus", "mp3", "flac", "mulaw"]


async def test_http_api_can_be_turned_off(make_app: Any) -> None:
    app = await make_app("--http-port", "0")
    assert app.http_port is None


async def test_engine_error_before_audio_is_a_json_500(app: App) -> None:
    status, _, answer = await post(app, {"model": "tts-1", "input": f"Broken {FAIL_MARKER} words."})
    assert_openai_error(status, answer, "engine_error", None, expected_status=500)
    assert answer["error"]["type"] == "server_error"
    await wait_until(lambda: app.active_streams == 0 and len(app.service.registry) == 0)


async def test_engine_error_after_audio_cuts_the_body_off(make_app: Any) -> None:
    # Without look-ahead the failing sentence runs only after the first one is sent.
    app = await make_app("--fake-step-ms", "30", "--segment-lookahead", "0")
    text = "This first sentence is fine and long enough for a few blocks. " + f"Then {FAIL_MARKER} fails."
    body = {"model": "tts-1", "input": text, "response_format": "pcm", "seed": 2}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{base_url(app)}/audio/speech", json=body) as resp,
    ):
        assert resp.status == 200
        # The chunked body never ends cleanly: the client cannot take it for a whole file.
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    await wait_until(lambda: fake_engine(app).live_sequences == 0 and len(app.service.registry) == 0)


async def test_drain_lets_a_running_response_finish_and_refuses_new_ones(make_app: Any) -> None:
    app = await make_app("--fake-step-ms", "20")
    body = {"model": "tts-1", "input": TEXT, "response_format": "pcm", "seed": 7}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base_url(app)}/audio/speech", json=body) as resp:
            first = await resp.content.readany()
            drain = asyncio.create_task(app.drain())
            await wait_until(lambda: app.draining)
            async with session.post(f"{base_url(app)}/audio/speech", json=body) as late:
                assert late.status == 503 and (await late.json())["error"]["code"] == "shutting_down"
            got = first + await resp.read()
        await drain
    reference = await reference_after_drain(TEXT, seed=7)
    assert got == reference


async def reference_after_drain(text: str, seed: int) -> bytes:
    """The expected PCM of a stream, from the fake engine's definition (the drained app is gone)."""
    segments = split_segments(text)
    params = SynthesisParams(seed=seed)
    parts = [
        expected_audio(SequenceRequest(seq_id=0, text=seg, params=params, seed_offset=k))
        for k, seg in enumerate(segments)
    ]
    return to_pcm16(np.concatenate(parts)).tobytes()


def busy_port_after_a_free_one() -> tuple[int, socket.socket]:
    """A port P that was free a moment ago and a listening socket on P + 1."""
    while True:
        port = free_port()
        blocker = socket.socket()
        try:
            blocker.bind(("127.0.0.1", port + 1))
        except OSError:
            blocker.close()
            continue
        blocker.listen()
        return port, blocker


async def test_a_busy_default_port_leaves_http_off_not_the_server(make_app: Any) -> None:
    port, blocker = busy_port_after_a_free_one()
    with blocker:
        app = await make_app("--port", str(port))  # the default http port is --port + 1: busy
        assert app.http_port is None
        ws, _ = await open_client(app.port)
        await ws.close()
        explicit = App(fake_settings("--http-port", str(port + 1)))
        try:
            with pytest.raises(StartupError, match="--http-port"):  # a port asked for explicitly must be had
                await explicit.start()
        finally:
            await explicit.stop()


async def test_api_keys_and_rate_limits_apply_as_on_the_websocket(make_app: Any) -> None:
    app = await make_app("--api-keys", "k1", "--rate-limit-per-min", "6", "--rate-limit-burst", "1")
    status, _, answer = await post(app, {"model": "tts-1", "input": "Hello."})
    assert_openai_error(status, answer, "invalid_api_key", None, expected_status=401)
    async with AsyncOpenAI(base_url=base_url(app), api_key="wrong", max_retries=0) as oai:
        with pytest.raises(openai.AuthenticationError):
            await oai.models.list()
    async with AsyncOpenAI(base_url=base_url(app), api_key="k1", max_retries=0) as oai:
        speech = await oai.audio.speech.create(
            model="tts-1", voice="alloy", input="Hello.", response_format="pcm"
        )
        assert len(speech.content) > 0
        # The burst is spent: the next stream of this key waits about 10 s (6 per minute).
        with pytest.raises(openai.RateLimitError) as limited:
            await oai.audio.speech.create(model="tts-1", voice="alloy", input="Again.", response_format="pcm")
    assert limited.value.code == "rate_limited"
    assert 5 <= int(limited.value.response.headers["Retry-After"]) <= 10
