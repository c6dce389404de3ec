"""Complete and live responses of the HTTP API, read by Python's readers (docs/protocol.md, Formats).

A live FLAC stream's STREAMINFO is sent before its length is known (0, "unknown"), which the
format allows and ffmpeg reads; libsndfile (``soundfile``) cannot: it takes the length as
2^63 - 1 frames and fails. So ``flac`` answers with the complete file, its length in
STREAMINFO (``Content-Length`` on the response), unless the body asks for a live stream
(``"stream": true``); ``"stream": false`` asks any format for its complete file. Real servers
on loopback sockets, the fake engine; the pcm16 stream of the same request is the reference.
"""

from __future__ import annotations

import asyncio
import io
import subprocess
import wave
from typing import Any

import aiohttp
import numpy as np
import pytest
import soundfile as sf

from server.app import App
from server.audio.flac import FLAC_HEADER_BYTES
from server.engine.fake import FAIL_MARKER
from tests.integration.conftest import wait_until
from tests.wsclient import stream_payload

TEXT = "A whole FLAC file, read back in Python."
#: About 18 s of the fake engine's audio (1024 samples a character at 24 kHz).
LONG_TEXT = "This long sentence keeps the fake engine busy for many blocks in a row. " * 6


async def speech(app: App, fmt: str, **extra: Any) -> tuple[bytes, dict[str, str]]:
    """The response body and headers of one seeded request."""
    body = {"input": TEXT, "response_format": fmt, "seed": 3, **extra}
    url = f"http://127.0.0.1:{app.http_port}/v1/audio/speech"
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.read(), dict(response.headers)


async def reference(app: App, text: str = TEXT, **fields: Any) -> np.ndarray:
    """The same request's pcm16 samples over the WebSocket."""
    return np.frombuffer(await stream_payload(app.port, text=text, seed=3, **fields), "<i2")


def streaminfo_total_samples(data: bytes) -> int:
    """STREAMINFO's total samples (RFC 9639: 36 bits, 18 bytes into the file)."""
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0 and len(data) >= FLAC_HEADER_BYTES
    return int.from_bytes(data[18:26], "big") & ((1 << 36) - 1)


# --- the complete file (flac's default) ----------------------------------------------------


@pytest.mark.parametrize("rate", [24_000, 16_000])
async def test_soundfile_reads_a_complete_flac_response(app: App, rate: int) -> None:
    data, headers = await speech(app, "flac", sample_rate=rate)
    assert headers["Content-Type"] == "audio/flac"
    assert int(headers["Content-Length"]) == len(data) and "Transfer-Encoding" not in headers
    audio, got_rate = sf.read(io.BytesIO(data), dtype="int16")
    expected = await reference(app, sample_rate=rate)
    assert got_rate == rate and len(audio) == len(expected) > rate  # a real multi-second stream
    assert np.array_equal(audio, expected)  # FLAC is lossless


async def test_an_http_1_0_client_gets_the_complete_file_with_its_length(app: App) -> None:
    body = {"input": TEXT, "response_format": "flac", "seed": 3}
    url = f"http://127.0.0.1:{app.http_port}/v1/audio/speech"
    async with (
        aiohttp.ClientSession(version=aiohttp.HttpVersion10) as session,
        session.post(url, json=body) as response,
    ):
        assert response.status == 200
        data = await response.read()
        assert int(response.headers["Content-Length"]) == len(data)
    assert np.array_equal(sf.read(io.BytesIO(data), dtype="int16")[0], await reference(app))


async def test_a_complete_flac_says_its_length_in_streaminfo(app: App) -> None:
    data, _ = await speech(app, "flac")
    assert streaminfo_total_samples(data) == len(await reference(app))  # never 0 ("unknown")
    # ffmpeg reads it too, to the same samples.
    wav = await asyncio.to_thread(ffmpeg_to_wav, data)
    assert np.array_equal(sf.read(io.BytesIO(wav), dtype="int16")[0], await reference(app))


async def test_a_complete_response_is_not_held_to_max_buffered_s(make_app: Any) -> None:
    # --max-buffered-s bounds a live reader that falls behind; a complete response holds the
    # whole stream unsent by design (the memory budget bounds it), so 18 s of audio goes out.
    app: App = await make_app("--max-buffered-s", "1")
    body = {"input": LONG_TEXT, "response_format": "flac", "seed": 3}
    url = f"http://127.0.0.1:{app.http_port}/v1/audio/speech"
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        assert response.status == 200
        data = await response.read()
    audio, rate = sf.read(io.BytesIO(data), dtype="int16")
    # The reference from a server with the default bound (a WebSocket reader may lag 1 s).
    expected = await reference(await make_app(), LONG_TEXT)
    assert rate == 24_000 and len(audio) > 10 * rate and np.array_equal(audio, expected)


async def test_a_complete_response_is_held_within_the_memory_budget(make_app: Any) -> None:
    # 18 s of wav at 48 kHz is 1.7 MB: over a 1 MiB budget when held whole, so the stream is
    # freed and its connection cut (no short file); read live, little is held and it completes.
    app: App = await make_app("--memory-budget-bytes", str(1 << 20), "--replay-max-bytes", "65536")
    url = f"http://127.0.0.1:{app.http_port}/v1/audio/speech"
    body = {"input": LONG_TEXT, "response_format": "wav", "sample_rate": 48_000, "seed": 3}
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientError):
            async with session.post(url, json={**body, "stream": False}) as response:
                await response.read()
        assert 'chattts_streams_total{reason="budget"} 1.0' in app.metrics.render().decode()
        async with session.post(url, json={**body, "stream": True}) as response:
            assert response.status == 200
            data = await response.read()
    assert len(sf.read(io.BytesIO(data))[0]) == len(await reference(app, LONG_TEXT, sample_rate=48_000))


async def test_stream_false_gives_any_format_its_complete_file(app: App) -> None:
    expected = await reference(app)
    data, headers = await speech(app, "wav", stream=False)
    assert int(headers["Content-Length"]) == len(data) == 44 + 2 * len(expected)
    with wave.open(io.BytesIO(data)) as w:  # the real sizes: getnframes is the length
        assert w.getnframes() == len(expected) and w.readframes(len(expected)) == expected.tobytes()
    # The other formats are the same bytes live or complete; only the transfer differs.
    live, live_headers = await speech(app, "mp3")
    complete, complete_headers = await speech(app, "mp3", stream=False)
    assert live_headers["Transfer-Encoding"] == "chunked" and "Content-Length" not in live_headers
    assert complete == live and int(complete_headers["Content-Length"]) == len(live)


async def test_a_complete_response_that_fails_after_audio_is_a_json_error(make_app: Any) -> None:
    # Live, the same request would be cut off after its first sentence's audio (a 200 and a
    # truncated body); complete, nothing went out yet, so the client gets the error itself.
    app: App = await make_app("--segment-lookahead", "0")
    text = f"This first sentence is fine and long enough for a few blocks. Then {FAIL_MARKER} fails."
    url = f"http://127.0.0.1:{app.http_port}/v1/audio/speech"
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json={"input": text, "response_format": "flac"}) as response,
    ):
        assert response.status == 500
        assert (await response.json())["error"]["code"] == "engine_error"
    await wait_until(lambda: len(app.service.registry) == 0 and app.service.budget.total == 0)


async def test_stream_must_be_a_boolean(app: App) -> None:
    body = {"input": TEXT, "response_format": "flac", "stream": "yes"}
    url = f"http://127.0.0.1:{app.http_port}/v1/audio/speech"
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert error["param"] == "stream" and error["code"] == "bad_request", error


# --- the live stream ("stream": true) ------------------------------------------------------


async def test_a_live_flac_stream_plays_with_ffmpeg_but_not_soundfile(app: App) -> None:
    data, headers = await speech(app, "flac", stream=True)
    assert headers["Transfer-Encoding"] == "chunked" and "Content-Length" not in headers
    assert streaminfo_total_samples(data) == 0  # unknown while it streams
    # The limitation (if libsndfile learns to read it, this fails: update docs/protocol.md).
    with pytest.raises((ValueError, sf.LibsndfileError)):
        sf.read(io.BytesIO(data))
    # ffmpeg reads it, as docs/protocol.md says (a thread: the test's event loop serves the server).
    wav = await asyncio.to_thread(ffmpeg_to_wav, data)
    audio, rate = sf.read(io.BytesIO(wav), dtype="int16")
    assert rate == 24_000 and np.array_equal(audio, await reference(app))


async def test_wav_is_the_format_soundfile_reads_as_it_streams(app: App) -> None:
    data, headers = await speech(app, "wav")
    assert headers["Transfer-Encoding"] == "chunked"
    audio, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == 24_000 and np.array_equal(audio, await reference(app))


def ffmpeg_to_wav(data: bytes) -> bytes:
    """ffmpeg's decoding of a FLAC file, as WAV."""
    return subprocess.run(
        ["ffmpeg", "-v", "error", "-i", "-", "-f", "wav", "-"],
        input=data,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
