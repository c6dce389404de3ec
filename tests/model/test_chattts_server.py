"""The tiny random-weight ChatTTS model behind the real server, over real WebSockets.

Only loopback traffic is allowed here: the server must never reach for the hub.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
from typing import Any

import numpy as np
import pytest
import soundfile
from openai import AsyncOpenAI
from wyoming.audio import AudioChunk, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

import chattts_stream_client as cs
from server.app import App
from tests.integration.conftest import wait_until
from tests.integration.test_client_py import raw_stream
from tests.integration.test_http_speech import base_url
from tests.integration.test_resume import broken_run, unbroken
from tests.tcp_proxy import CuttableProxy
from tests.wsclient import collect, open_client, start

TEXT = "第一句话在这里。The second sentence is here. 第三句话结束了。"
pytestmark = pytest.mark.loopback  # our own server on 127.0.0.1, nothing else


#: The look-ahead gate (``--lookahead-lead-s``) lets a stream's next segment step only while
#: the stream is that far ahead of real time: a wall-clock rule, so whether a segment decodes
#: alone or in one batched call with its neighbour depends on timing (and on how fast the
#: client reads), and a batched float32 decode rounds differently from a lone one (one sample
#: off by one LSB here and there). The tests here compare streams byte for byte, so they run
#: the gate off (0: look-ahead always steps, a schedule that depends on tokens only); the
#: default gate is held to the 1-LSB rule by ``test_cut_and_resume_with_the_default_lead``.
DETERMINISTIC_SCHEDULE = ("--lookahead-lead-s", "0")


@pytest.fixture
async def model_app(make_model_app: Any) -> App:
    app: App = await make_model_app("--resume-ttl-s", "30", "--wyoming-port", "-1", *DETERMINISTIC_SCHEDULE)
    return app


async def test_three_sentences_stream_with_token_implied_lengths(model_app: App) -> None:
    ws, hello = await open_client(model_app.port)
    assert hello["server"].endswith("(chattts)")
    assert hello["weights"] == "random"  # a dev model, hash-checked against its own manifest
    assert 'weights="random"' in model_app.metrics.render().decode()
    tokens_before = _tokens(model_app)
    await start(ws, id="m", text=TEXT, seed=3)
    log = (await collect(ws, {"m"}))["m"]
    await ws.close()
    assert log.done is not None and log.done["reason"] == "complete"
    assert [s["text"] for s in log.segments] == [
        "第一句话在这里。",
        "The second sentence is here.",
        "第三句话结束了。",
    ]
    assert [f.header.seq for f in log.frames] == list(range(len(log.frames)))
    total = log.done["samples"]
    assert total == len(log.payload) // 2
    # Each segment's audio is what its tokens decode to: 512·N − 256 samples.
    starts = [s["sample"] for s in log.segments] + [total]
    lengths = [b - a for a, b in itertools.pairwise(starts)]
    assert all(length > 0 and (length + 256) % 512 == 0 for length in lengths), lengths
    tokens = _tokens(model_app) - tokens_before
    assert total == 512 * tokens - 256 * len(lengths)


async def test_same_seed_alone_twice_is_identical(model_app: App) -> None:
    payloads = []
    for _ in range(2):
        ws, _ = await open_client(model_app.port)
        await start(ws, id="d", text=TEXT, seed=42, voice="seed:7")
        payloads.append((await collect(ws, {"d"}))["d"].payload)
        await ws.close()
    assert payloads[0] == payloads[1] and len(payloads[0]) > 0


@pytest.mark.parametrize("fmt", ["pcm16", "opus"])
async def test_cut_and_resume_with_the_tiny_model(model_app: App, fmt: str) -> None:
    expected = await unbroken(model_app.port, fmt, 5)
    got = await broken_run(model_app.port, fmt, 5, [3, 9])
    assert got == expected


async def test_cut_and_resume_with_the_default_lead(make_model_app: Any) -> None:
    """With the default look-ahead gate, a cut and resumed stream has every frame of an unbroken
    run (same sequence numbers, flags, sample offsets and done), each sample within one LSB."""
    app: App = await make_model_app("--resume-ttl-s", "30")
    expected = await unbroken(app.port, "pcm16", 5)
    got = await broken_run(app.port, "pcm16", 5, [3, 9])
    assert sorted(got) == sorted(expected) and got[-1] == expected[-1]
    for seq in sorted(s for s in expected if s >= 0):
        assert got[seq][:5] == expected[seq][:5], f"frame {seq}: flags or sample offset"
        ours, theirs = (np.frombuffer(got[seq][5:], "<i2"), np.frombuffer(expected[seq][5:], "<i2"))
        assert len(ours) == len(theirs) and np.abs(ours.astype(np.int32) - theirs).max(initial=0) <= 1, seq


async def test_incremental_text_with_the_tiny_model(model_app: App) -> None:
    ws, _ = await open_client(model_app.port)
    await start(ws, id="i", incremental=True, seed=8, max_buffer_delay_ms=5000)
    for piece in ["第一句", "话在这里。", "The second ", "sentence is here. ", "第三句话", "结束了。"]:
        await ws.send(json.dumps({"type": "append", "id": "i", "text": piece}))
    await ws.send(json.dumps({"type": "end", "id": "i"}))
    log = (await collect(ws, {"i"}))["i"]
    await start(ws, id="o", text=TEXT, seed=8)
    once = (await collect(ws, {"o"}))["o"]
    await ws.close()
    assert [s["text"] for s in log.segments] == [s["text"] for s in once.segments]
    assert log.done is not None and log.done["reason"] == "complete"
    assert log.payload == once.payload


async def test_wyoming_with_the_tiny_model(model_app: App) -> None:
    """Home Assistant's two forms over the real model: the WebSocket stream's bytes (same seed)."""
    assert model_app.wyoming_port is not None
    reference = await raw_stream(model_app.port, text=TEXT, seed=0, format="pcm16")
    expected = b"".join(data for _, _, _, data in reference[0])
    pieces = ["第一句", "话在这里。", "The second ", "sentence is here. ", "第三句话", "结束了。"]
    for streaming in (False, True):
        client = AsyncTcpClient("127.0.0.1", model_app.wyoming_port, connect_timeout=10, read_timeout=120)
        async with client:
            if streaming:
                await client.write_event(SynthesizeStart().event())
                for piece in pieces:
                    await client.write_event(SynthesizeChunk(piece).event())
                await client.write_event(SynthesizeStop().event())
            else:
                await client.write_event(Synthesize(TEXT).event())
            audio, last = b"", SynthesizeStopped if streaming else AudioStop
            while (event := await client.read_event()) is not None and not last.is_type(event.type):
                assert event.type in ("audio-start", "audio-chunk", "audio-stop"), event
                audio += AudioChunk.from_event(event).audio if AudioChunk.is_type(event.type) else b""
        assert event is not None and audio == expected and len(audio) > 0


async def test_a_complete_flac_from_the_http_api_opens_in_soundfile(model_app: App) -> None:
    """``flac`` from the OpenAI endpoint is the complete file: soundfile reads the model's samples."""
    reference = await raw_stream(model_app.port, text=TEXT, seed=5, voice="seed:7", format="pcm16")
    expected = np.frombuffer(b"".join(data for _, _, _, data in reference[0]), "<i2")
    async with AsyncOpenAI(base_url=base_url(model_app), api_key="x", max_retries=0, timeout=120) as oai:
        response = await oai.audio.speech.create(
            model="tts-1", voice="seed:7", input=TEXT, response_format="flac", extra_body={"seed": 5}
        )
    audio, rate = soundfile.read(io.BytesIO(response.content), dtype="int16")
    assert rate == 24_000 and len(audio) == len(expected) > 0 and np.array_equal(audio, expected)


def _tokens(app: App) -> int:
    for line in app.metrics.render().decode().splitlines():
        if line.startswith("chattts_tokens_generated_total "):
            return int(float(line.split()[1]))
    raise AssertionError("no token counter")


async def test_python_client_resumes_a_cut_model_stream_byte_for_byte(model_app: App) -> None:
    expected, done = await raw_stream(model_app.port, text=TEXT, seed=5, format="mp3")
    async with CuttableProxy(model_app.port) as proxy:
        client = cs.Client(f"ws://127.0.0.1:{proxy.port}/v1/stream", read_timeout=120, max_queued_chunks=1)
        async with client:
            stream = client.speak(TEXT, seed=5, format="mp3")
            got = []
            async for chunk in stream:
                got.append((chunk.seq, chunk.sample, chunk.last, chunk.data))
                if len(got) == 1:
                    proxy.cut()
    assert got == expected and stream.done is not None and stream.done.samples == done["samples"]
    assert proxy.cuts == 1 and stream.resumes <= 1


async def test_kv_cache_size_is_exported(model_app: App) -> None:
    """The preallocated KV cache is known from start-up and exported (fp32 tiny model, 16 slots)."""
    lines = model_app.metrics.render().decode().splitlines()
    [value] = [float(line.split()[1]) for line in lines if line.startswith("chattts_kv_cache_bytes ")]
    assert value > 0 and value % (2 * 2 * 16 * 4) == 0  # K and V · layers · slots · fp32 bytes divide it


def _gauge(app: App, name: str) -> float:
    for line in app.metrics.render().decode().splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no {name}")


async def test_resident_kv_memory_is_exported_as_it_changes(model_app: App) -> None:
    """``chattts_kv_resident_bytes`` follows the engine: up while a stream's rows live, back after."""
    reserved = _gauge(model_app, "chattts_kv_cache_bytes")
    seen: list[float] = []
    ws, _ = await open_client(model_app.port)
    await start(ws, id="m", text=TEXT * 3, seed=5)
    collecting = asyncio.create_task(collect(ws, {"m"}))
    try:
        async with asyncio.timeout(60):
            while not collecting.done():  # sampled while the stream generates
                seen.append(_gauge(model_app, "chattts_kv_resident_bytes"))
                await asyncio.sleep(0.002)
            log = (await collecting)["m"]
    finally:
        collecting.cancel()
    await ws.close()
    assert log.done is not None and log.done["reason"] == "complete"
    assert 0 < max(seen) <= reserved
    engine = model_app.engine_client.engine
    assert engine is not None
    await wait_until(lambda: _gauge(model_app, "chattts_kv_resident_bytes") == engine.kv_resident_bytes())
