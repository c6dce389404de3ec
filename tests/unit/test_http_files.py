"""The file a speech response's body makes (``server.frontends.http.files``): pure functions."""

from __future__ import annotations

import io
import wave

import numpy as np
import soundfile

from server.audio.flac import FlacEncoder
from server.frontends.http.files import complete_file, live_head, pieces, wav_header


def test_a_complete_wav_has_its_sizes_and_a_live_one_says_unknown() -> None:
    samples = np.arange(-500, 500, dtype="<i2")
    parts = complete_file("wav", [samples[:300].tobytes(), samples[300:].tobytes()], 1000, 16_000)
    data = b"".join(parts)
    assert data[4:8] == (36 + 2000).to_bytes(4, "little") and data[40:44] == (2000).to_bytes(4, "little")
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnframes()) == (16_000, 1000)
        assert w.readframes(1000) == samples.tobytes()
    assert live_head("wav", 16_000) == wav_header(16_000)
    assert wav_header(16_000)[4:8] == wav_header(16_000)[40:44] == b"\xff" * 4
    assert live_head("flac", 16_000) == live_head("mp3", 16_000) == b""


def test_a_complete_flac_gets_its_length_even_when_its_header_comes_in_pieces() -> None:
    audio = np.sin(np.arange(20_000) / 9).astype(np.float32) * 0.3
    encoder = FlacEncoder(24_000)
    data = b"".join(f.payload for f in [*encoder.push(audio), *encoder.finish()])
    split = [data[:5], data[5:30], data[30:]]  # STREAMINFO across three payloads
    out = b"".join(complete_file("flac", split, len(audio), 24_000))
    decoded, rate = soundfile.read(io.BytesIO(out), dtype="float32")
    assert rate == 24_000 and len(decoded) == len(audio)
    assert complete_file("mp3", split, len(audio), 24_000) == split  # the same bytes


def test_pieces_join_parts_in_order_into_writes_of_about_a_size() -> None:
    parts = [bytes([k]) * n for k, n in enumerate([10, 30, 70, 5, 5, 1])]
    out = list(pieces(parts, 40))
    assert b"".join(out) == b"".join(parts)
    assert [len(p) for p in out] == [40, 70, 11]
    assert list(pieces([], 40)) == []
