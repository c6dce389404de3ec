"""The file a speech response's body makes, live or complete, by OpenAI ``response_format``.

A live response starts before its length is known: ``wav`` goes out behind a header whose
sizes say "unknown" (0xFFFFFFFF, which ``wave``, libsndfile and ffmpeg read to the end), and
``flac``'s STREAMINFO says 0 ("unknown"), which ffmpeg reads but libsndfile (``soundfile``)
cannot. A complete response is sent once the stream has ended, so its headers carry the
length: WAV's RIFF and data sizes, FLAC's total samples. Every other format is the same bytes
either way. Pure functions: no sockets.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator

from server.audio.flac import FLAC_HEADER_BYTES, with_total_samples

#: The size WAV's RIFF and data fields carry for a stream of unknown length.
_UNKNOWN_SIZE = 0xFFFFFFFF
#: The bytes of a 16-bit mono WAV header before the audio.
WAV_HEADER_BYTES = 44


def wav_header(sample_rate: int, data_bytes: int | None = None) -> bytes:
    """A 16-bit mono WAV header: for ``data_bytes`` of audio, or (None) a stream of unknown length."""
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    data = _UNKNOWN_SIZE if data_bytes is None else data_bytes
    riff = _UNKNOWN_SIZE if data_bytes is None else WAV_HEADER_BYTES - 8 + data_bytes
    return (
        b"RIFF" + struct.pack("<I", riff) + b"WAVE"
        b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", data)
    )


def live_head(response_format: str, sample_rate: int) -> bytes:
    """What a live response sends before its first audio (a WAV header of unknown length)."""
    return wav_header(sample_rate) if response_format == "wav" else b""


def complete_file(response_format: str, payloads: list[bytes], samples: int, sample_rate: int) -> list[bytes]:
    """The parts of a complete file: ``payloads`` (a whole stream's, in order) with the length in its header.

    Only a small part is copied (a WAV header before them, or FLAC's first payload with its
    total samples); the audio's bytes are the stream's own.

    Args:
        response_format: the OpenAI name (``wav``, ``flac``, ...).
        payloads: every frame payload of the stream.
        samples: the stream's length in samples at ``sample_rate`` (``done``'s).
        sample_rate: the output rate.
    """
    if response_format == "wav":
        return [wav_header(sample_rate, sum(map(len, payloads))), *payloads]
    if response_format == "flac":
        # STREAMINFO is in the first payload, whole; joining the first few only guards that.
        first = 1
        while first < len(payloads) and sum(map(len, payloads[:first])) < FLAC_HEADER_BYTES:
            first += 1
        return [with_total_samples(b"".join(payloads[:first]), samples), *payloads[first:]]
    return payloads


def pieces(parts: Iterable[bytes], size: int) -> Iterator[bytes]:
    """``parts`` joined into writes of about ``size`` bytes (one part more, at most), in order."""
    batch: list[bytes] = []
    held = 0
    for part in parts:
        batch.append(part)
        held += len(part)
        if held >= size:
            yield b"".join(batch)
            batch, held = [], 0
    if batch:
        yield b"".join(batch)
