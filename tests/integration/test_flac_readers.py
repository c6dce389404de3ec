"""A complete ``flac`` response and the Python readers (docs/protocol.md, Formats: the workaround).

The FLAC stream's STREAMINFO is sent before its length is known (0, "unknown"), which the
format allows and ffmpeg, ``flac`` and browsers read; libsndfile (``soundfile``) cannot: it
takes the length as 2^63 - 1 frames and fails. That cannot change while the body streams, so
the documented workaround is tested here in the form the docs give it.
"""

from __future__ import annotations

import io
import subprocess

import aiohttp
import pytest
import soundfile as sf

from server.app import App
from tests.wsclient import stream_payload

TEXT = "A whole FLAC file, read back in Python."


async def flac_response(app: App) -> bytes:
    body = {"input": TEXT, "response_format": "flac", "seed": 3}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{app.http_port}/v1/audio/speech", json=body) as response:
            assert response.status == 200 and response.content_type == "audio/flac"
            return await response.read()


async def test_soundfile_cannot_open_a_streamed_flac_and_the_documented_workaround_can(app: App) -> None:
    data = await flac_response(app)
    # The limitation (if libsndfile learns to read it, this fails: update docs/protocol.md).
    with pytest.raises((ValueError, sf.LibsndfileError)):
        sf.read(io.BytesIO(data))
    # The workaround, as docs/protocol.md gives it: ffmpeg reads it, soundfile takes the WAV.
    wav = subprocess.run(
        ["ffmpeg", "-i", "-", "-f", "wav", "-"], input=data, capture_output=True, check=True
    ).stdout
    audio, rate = sf.read(io.BytesIO(wav), dtype="int16")
    assert rate == 24_000 and audio.tobytes() == await stream_payload(app.port, text=TEXT, seed=3)


async def test_wav_is_the_format_soundfile_reads_as_it_streams(app: App) -> None:
    body = {"input": TEXT, "response_format": "wav", "seed": 3}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{app.http_port}/v1/audio/speech", json=body) as response:
            data = await response.read()
    audio, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == 24_000 and audio.tobytes() == await stream_payload(app.port, text=TEXT, seed=3)
