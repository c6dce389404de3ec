"""``make_encoder``: every advertised format x rate works, options reach the encoders, errors are clear."""

from __future__ import annotations

import numpy as np
import pytest

from server.audio import (
    SUPPORTED_FORMATS,
    SUPPORTED_RATES,
    OggOpusEncoder,
    OpusEncoder,
    ResamplingEncoder,
    UnsupportedAudio,
    make_encoder,
    opus_preskip,
    resampled_length,
)


def test_advertised_sets() -> None:
    assert SUPPORTED_FORMATS == ("pcm16", "f32", "opus", "ogg", "mp3", "flac", "mulaw")
    assert SUPPORTED_RATES == (8_000, 16_000, 24_000, 48_000)


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
@pytest.mark.parametrize("rate", SUPPORTED_RATES)
def test_every_combination_sums_to_the_resampled_length(fmt: str, rate: int) -> None:
    n = 9_001
    encoder = make_encoder(fmt, rate)  # the original positional signature still works
    assert (encoder.format, encoder.sample_rate) == (fmt, rate)
    audio = (0.2 * np.sin(np.arange(n) * 0.02)).astype(np.float32)
    frames = encoder.push(audio[:5000]) + encoder.push(audio[5000:]) + encoder.finish()
    assert sum(f.samples for f in frames) == resampled_length(n, 24_000, rate)
    assert frames and all(f.samples >= 0 for f in frames)


def test_options_reach_the_encoders() -> None:
    enc = make_encoder("ogg", 48_000, opus_bitrate=20_000, opus_complexity=9, ogg_page_ms=60, ogg_serial=5)
    assert isinstance(enc, ResamplingEncoder)
    inner = enc.inner
    assert isinstance(inner, OggOpusEncoder)
    assert (inner.stream.bitrate, inner.stream.complexity, inner.page_packets, inner.serial) == (
        20_000, 9, 3, 5,
    )  # fmt: skip
    opus = make_encoder("opus", 24_000)
    assert isinstance(opus, OpusEncoder)
    assert (opus.stream.bitrate, opus.stream.complexity) == (32_000, 5)  # documented defaults


def test_unsupported() -> None:
    with pytest.raises(UnsupportedAudio, match="format"):
        make_encoder("aac", 24_000)
    with pytest.raises(UnsupportedAudio, match="sample_rate"):
        make_encoder("pcm16", 44_100)
    with pytest.raises(ValueError):
        make_encoder("pcm16", 16_000, resample_quality="nope")


def test_opus_preskip_helper() -> None:
    assert [opus_preskip(make_encoder("opus", r)) for r in SUPPORTED_RATES] == [52, 104, 156, 312]
    assert opus_preskip(make_encoder("ogg", 24_000)) == 0  # carried in OpusHead instead
    assert opus_preskip(make_encoder("pcm16", 48_000)) == 0
