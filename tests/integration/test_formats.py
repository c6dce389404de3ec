"""mp3, flac and mulaw through real sockets: the official OpenAI client, the WebSocket, real decoders."""

from __future__ import annotations

import io
import itertools
import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
from openai import AsyncOpenAI

from server.app import App
from server.audio.flac import FlacEncoder
from server.audio.mp3 import Mp3Encoder, frame_samples
from server.audio.mulaw import DECODE_TABLE, ENCODE_TABLE
from server.audio.pcm import PcmEncoder
from server.voices.catalog import OPENAI_VOICES
from tests.integration.test_http_speech import TEXT, base_url, post, ws_payload
from tests.unit.test_audio_formats import ffmpeg_decode as ffmpeg
from tests.unit.test_audio_formats import snr_db
from tests.wsclient import collect, open_client, start


def probe_rate(data: bytes, fmt: str) -> int:
    out = subprocess.run(
        ["ffprobe", "-v", "error", "-f", fmt, "-show_streams", "-of", "json", "pipe:0"],
        input=data,
        capture_output=True,
        check=True,
        timeout=60,
    )
    return int(json.loads(out.stdout)["streams"][0]["sample_rate"])


async def openai_stream(app: App, tmp_path: Path, fmt: str, **extra: Any) -> tuple[bytes, str]:
    out = tmp_path / f"speech.{fmt}"
    async with (
        AsyncOpenAI(base_url=base_url(app), api_key="x", max_retries=0) as oai,
        oai.audio.speech.with_streaming_response.create(
            model="tts-1", voice="echo", input=TEXT, response_format=fmt, extra_body={"seed": 7, **extra}
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers.get("transfer-encoding") == "chunked"
        await response.stream_to_file(out)
        return out.read_bytes(), response.headers["content-type"]


async def test_openai_client_streams_flac_losslessly(app: App, tmp_path: Path) -> None:
    got, content_type = await openai_stream(app, tmp_path, "flac", stream=True)  # live, on request
    assert content_type == "audio/flac"
    reference = np.frombuffer(
        await ws_payload(app, text=TEXT, seed=7, voice=OPENAI_VOICES["echo"], format="pcm16"), "<i2"
    )
    assert probe_rate(got, "flac") == 24_000
    decoded = np.rint(ffmpeg(got, "flac") * 32768).astype(np.int64)
    assert len(decoded) == len(reference) and np.array_equal(decoded, reference)  # exact length, lossless


async def test_openai_client_gets_a_complete_flac_that_soundfile_reads(app: App) -> None:
    async with AsyncOpenAI(base_url=base_url(app), api_key="x", max_retries=0) as oai:
        response = await oai.audio.speech.create(
            model="tts-1", voice="echo", input=TEXT, response_format="flac", extra_body={"seed": 7}
        )
    assert response.response.headers["content-length"] == str(len(response.content))
    reference = np.frombuffer(
        await ws_payload(app, text=TEXT, seed=7, voice=OPENAI_VOICES["echo"], format="pcm16"), "<i2"
    )
    audio, rate = soundfile.read(io.BytesIO(response.content), dtype="int16")
    assert rate == 24_000 and len(audio) == len(reference) and np.array_equal(audio, reference)


async def test_openai_client_streams_mp3_within_a_frame(app: App, tmp_path: Path) -> None:
    got, content_type = await openai_stream(app, tmp_path, "mp3")
    assert content_type == "audio/mpeg"
    reference = (
        np.frombuffer(
            await ws_payload(app, text=TEXT, seed=7, voice=OPENAI_VOICES["echo"], format="pcm16"), "<i2"
        ).astype(np.float32)
        / 32768
    )
    assert probe_rate(got, "mp3") == 24_000
    decoded = ffmpeg(got, "mp3")
    # ffmpeg applies the Info tag's delay and plays the tag frame as one frame of silence
    # (docs/protocol.md, Formats): the stream follows it, then less than one frame of padding.
    frame = frame_samples(24_000)
    assert 0 <= len(decoded) - frame - len(reference) < frame
    assert snr_db(reference, decoded[frame : frame + len(reference)]) > 5


async def test_mp3_is_the_default_format(app: App) -> None:
    status, headers, body = await post(app, {"model": "tts-1", "input": "Hello there.", "seed": 1})
    assert status == 200 and headers["Content-Type"] == "audio/mpeg"
    assert body[:2] == b"\xff\xf3" and b"Info" in body[:64]  # MPEG-2 Layer III, the LAME tag frame


def g711_error_bound(reference: np.ndarray) -> np.ndarray:
    """Per-sample bound of a μ-law round trip: half a step of the sample's segment, plus the 14-bit cut."""
    codes = ENCODE_TABLE[reference.astype(np.int64) + 32_768]
    segment = ((codes ^ 0xFF) >> 4 & 7).astype(np.int64)
    return (1 << (segment + 2)) + 3


async def test_mulaw_is_g711_of_the_8khz_pcm_stream(app: App) -> None:
    # OpenAI endpoint: response_format "mulaw" is 8 kHz (audio/basic).
    status, headers, body = await post(
        app, {"model": "tts-1", "input": TEXT, "voice": "echo", "response_format": "mulaw", "seed": 7}
    )
    assert status == 200 and headers["Content-Type"] == "audio/basic"
    pcm_8k = np.frombuffer(
        await ws_payload(
            app, text=TEXT, seed=7, voice=OPENAI_VOICES["echo"], format="pcm16", sample_rate=8_000
        ),
        "<i2",
    )
    assert len(body) == len(pcm_8k) > 8_000
    decoded = DECODE_TABLE[np.frombuffer(body, np.uint8)].astype(np.int64)
    clipped = np.abs(pcm_8k) <= 32_124  # above it G.711 clips
    error = np.abs(decoded - pcm_8k)
    assert np.all((error <= g711_error_bound(pcm_8k))[clipped])
    # The WebSocket's mulaw at 8 kHz is the same bytes, in 20 ms frames of 160 bytes.
    voice = OPENAI_VOICES["echo"]
    ws = await ws_payload(app, text=TEXT, seed=7, voice=voice, format="mulaw", sample_rate=8_000)
    assert ws == body


@pytest.mark.parametrize("fmt", ["mp3", "flac", "mulaw"])
async def test_websocket_formats_keep_the_frame_contract(app: App, fmt: str) -> None:
    ws, hello = await open_client(app.port)
    assert fmt in hello["formats"] and 8_000 in hello["sample_rates"]
    await start(ws, id="f", text=TEXT, seed=3, format=fmt, sample_rate=16_000)
    log = (await collect(ws, {"f"}))["f"]
    await ws.close()
    assert log.started is not None and (log.started["format"], log.started["sample_rate"]) == (fmt, 16_000)
    assert log.done is not None and log.done["reason"] == "complete"
    headers = [f.header for f in log.frames]
    assert [h.seq for h in headers] == list(range(len(headers)))
    assert headers[-1].flags & 1 and not any(h.flags & 1 for h in headers[:-1])
    reference = await ws_payload(app, text=TEXT, seed=3, format="pcm16", sample_rate=16_000)
    assert log.done["samples"] == len(reference) // 2  # exact ends: the PCM stream's length
    # Offsets are on the PCM timeline and every segment mark sits in the frame holding its sample.
    assert all(b.sample >= a.sample for a, b in itertools.pairwise(headers))
    starts = {h.seq: h.sample for h in headers}
    for mark in log.segments:
        assert starts[mark["seq"]] <= mark["sample"]


@pytest.mark.parametrize(("fmt", "cls"), [("mp3", Mp3Encoder), ("flac", FlacEncoder), ("mulaw", PcmEncoder)])
async def test_encoders_run_off_the_event_loop(
    make_app: Any, monkeypatch: pytest.MonkeyPatch, fmt: str, cls: type
) -> None:
    seen: list[tuple[str, bool]] = []
    original = cls.push

    def push(self: Any, audio: Any) -> Any:
        seen.append((self.format, threading.current_thread() is threading.main_thread()))
        return original(self, audio)

    monkeypatch.setattr(cls, "push", push)
    app = await make_app()
    await ws_payload(app, text="Off the loop, please.", seed=1, format=fmt, sample_rate=24_000)
    ours = [on_main for name, on_main in seen if name == fmt]
    assert ours and not any(ours)
