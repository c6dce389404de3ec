"""Stream resampling (soxr): chunking makes no difference, lengths are exact, the signal is right."""

from __future__ import annotations

import numpy as np
import pytest
import soxr
from hypothesis import given, settings
from hypothesis import strategies as st

from server.audio import make_encoder
from server.audio.resample import StreamResampler, resampled_length

# Tolerance for chunked vs one-shot: libsoxr's stream filter state makes them
# identical in practice (max difference measured 0.0); 1e-6 (-120 dBFS, far
# below int16's 3e-5 step) leaves room for a future libsoxr to regroup float
# sums without letting any seam (which would be >= 1e-3) through.
TOLERANCE = 1e-6


def chunked(resampler: StreamResampler, audio: np.ndarray, sizes: list[int]) -> np.ndarray:
    parts, pos, i = [], 0, 0
    while pos < len(audio):
        parts.append(resampler.push(audio[pos : pos + sizes[i % len(sizes)]]))
        pos += sizes[i % len(sizes)]
        i += 1
    parts.append(resampler.finish())
    return np.concatenate(parts)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 6000),
    sizes=st.lists(st.integers(1, 2500), min_size=1, max_size=8),
    rate=st.sampled_from([16_000, 48_000]),
    seed=st.integers(0, 2**16),
)
def test_chunked_equals_one_shot(n: int, sizes: list[int], rate: int, seed: int) -> None:
    audio = (0.3 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)
    out = chunked(StreamResampler(24_000, rate), audio, sizes)
    assert len(out) == resampled_length(n, 24_000, rate)
    if n:
        one_shot = soxr.resample(audio, 24_000, rate)
        assert len(one_shot) == len(out)
        assert np.max(np.abs(out - one_shot)) <= TOLERANCE


@pytest.mark.parametrize(
    ("n", "rate", "expected"),
    [(0, 16_000, 0), (1, 16_000, 1), (2, 16_000, 1), (3, 16_000, 2), (1001, 16_000, 667),
     (24_001, 16_000, 16_001), (7, 48_000, 14), (24_000, 24_000, 24_000)],
)  # fmt: skip
def test_resampled_length(n: int, rate: int, expected: int) -> None:
    assert resampled_length(n, 24_000, rate) == expected == round(n * rate / 24_000)
    audio = np.zeros(n, np.float32)
    assert len(chunked(StreamResampler(24_000, rate), audio, [333])) == expected


@pytest.mark.parametrize("rate", [16_000, 48_000])
def test_tone_survives_resampling(rate: int) -> None:
    # A 1 kHz tone must come out as the same tone at the new rate, in phase
    # (libsoxr compensates its filter delay), with only filter-level error.
    t_in = np.arange(24_000) / 24_000
    out = chunked(StreamResampler(24_000, rate), np.sin(2 * np.pi * 1000 * t_in).astype(np.float32), [1000])
    t_out = np.arange(len(out)) / rate
    ideal = np.sin(2 * np.pi * 1000 * t_out)
    core = slice(rate // 10, -rate // 10)  # skip the stream edges (filter ramp-in/out)
    err = np.sqrt(np.mean((out[core] - ideal[core]) ** 2))
    assert err < 1e-3  # better than -60 dB; HQ measured about -135 dB


@pytest.mark.parametrize("fmt", ["pcm16", "f32"])
@pytest.mark.parametrize("rate", [16_000, 48_000])
def test_pcm_at_other_rates(fmt: str, rate: int) -> None:
    n = 24_000 + 17
    audio = (0.2 * np.sin(np.arange(n) * 0.03)).astype(np.float32)
    encoder = make_encoder(fmt, rate)
    assert encoder.sample_rate == rate and encoder.format == fmt
    frames = []
    for start in range(0, n, 4000):
        frames += encoder.push(audio[start : start + 4000])
    frames += encoder.finish()
    width = 2 if fmt == "pcm16" else 4
    frame = rate // 50
    assert sum(f.samples for f in frames) == resampled_length(n, 24_000, rate)
    assert all(len(f.payload) == f.samples * width for f in frames)
    assert all(f.samples == frame for f in frames[:-1]) and frames[-1].samples < frame


def test_identity_and_misuse() -> None:
    same = StreamResampler(24_000, 24_000)
    x = np.arange(5, dtype=np.float32)
    assert np.array_equal(same.push(x), x) and len(same.finish()) == 0
    r = StreamResampler(24_000, 16_000)
    r.finish()
    with pytest.raises(RuntimeError):
        r.push(x)
    with pytest.raises(RuntimeError):
        r.finish()
    with pytest.raises(ValueError):
        StreamResampler(24_000, 16_000, quality="best")
    with pytest.raises(ValueError):
        StreamResampler(0, 16_000)
