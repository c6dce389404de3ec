"""A complete ``flac`` response and the Python readers (docs/protocol.md, Formats: the workaround).

The FLAC stream's STREAMINFO is sent before its length is known (0, "unknown"), which the
format allows and ffmpeg, ``flac`` and browsers read; libsndfile (``soundfile``) cannot: it
takes the length as 2^63 - 1 frames and fails. That cannot change while the body streams, so
the documented workaround is tested here in the form the docs give it.
"""

from __future__ import annotations

import asyncio
import io
import subprocess

import aiohttp
import pytest
import soundfile as sf

from server.app import App
from tests.wsclient import stream_payload

TEXT = "A whole FLAC file, read back in Python."


async def speech(app: App, fmt: str) -> bytes:
    body = {"input": TEXT, "response_format": fmt, "seed": 3}
    url = f"http://127.0.0.1:{app.http_port}/v1/audio/speech"
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        assert response.status == 200 and response.content_type == f"audio/{fmt}"
        return await response.read()


async def test_soundfile_cannot_open_a_streamed_flac_and_the_documented_workaround_can(app: App) -> None:
    data = await speech(app, "flac")
    # The limitation (if libsndfile learns to read it, this fails: update docs/protocol.md).
    with pytest.raises((ValueError, sf.LibsndfileError)):
        sf.read(io.BytesIO(data))
    # The workaround, as docs/protocol.md gives it: ffmpeg reads it, soundfile takes the WAV.
    # (a thread here: the test's event loop also serves the server)
    wav = await asyncio.to_thread(ffmpeg_to_wav, data)
    audio, rate = sf.read(io.BytesIO(wav), dtype="int16")
    assert rate == 24_000 and audio.tobytes() == await stream_payload(app.port, text=TEXT, seed=3)


async def test_wav_is_the_format_soundfile_reads_as_it_streams(app: App) -> None:
    audio, rate = sf.read(io.BytesIO(await speech(app, "wav")), dtype="int16")
    assert rate == 24_000 and audio.tobytes() == await stream_payload(app.port, text=TEXT, seed=3)


def ffmpeg_to_wav(data: bytes) -> bytes:
    """The documented workaround's first line."""
    return subprocess.run(
        ["ffmpeg", "-i", "-", "-f", "wav", "-"], input=data, capture_output=True, check=True
    ).stdout
