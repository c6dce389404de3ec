"""Test signals and helpers shared by the audio unit tests (not a test module)."""

from __future__ import annotations

import numpy as np
import opuslib

from server.audio.base import EncodedFrame
from server.engine.fake import expected_audio
from server.engine_api import SequenceRequest, SynthesisParams

TEXT = "你好，欢迎使用语音服务。今天天气很好，我们一起去公园散步吧。"


def fake_audio(seed: int = 7, text: str = TEXT) -> np.ndarray:
    """The fake engine's deterministic audio for a seeded request (gliding tones)."""
    return expected_audio(SequenceRequest(seq_id=1, text=text, params=SynthesisParams(seed=seed)))


def speech_like(seconds: float = 2.0, rate: int = 24_000, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """A crude vowel/fricative/pause sequence: harmonics of a gliding f0 shaped by moving formants.

    Closer to what ChatTTS emits than pure tones: a rich harmonic spectrum up
    to ~8 kHz, noise bursts and silences, amplitude envelopes.
    """
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    t = np.arange(n) / rate
    f0 = 120.0 + 40.0 * np.sin(2 * np.pi * 0.7 * t) + 20.0 * np.sin(2 * np.pi * 3.1 * t)
    phase = np.cumsum(f0) / rate
    seg = (t / 0.15).astype(int)  # a new "phone" every 150 ms
    vowels = np.array([[700, 1200, 2600], [300, 2300, 3000], [500, 900, 2500], [400, 1900, 2600]], float)
    formants = vowels[rng.integers(0, len(vowels), seg.max() + 1)][seg]
    voiced = np.zeros(n)
    for h in range(1, 60):
        fh = h * f0
        gain = sum(1.0 / (1.0 + ((fh - formants[:, j]) / (80.0 + 40 * j)) ** 2) for j in range(3))
        voiced += np.where(fh < rate / 2 - 500, gain / h**0.5, 0.0) * np.sin(2 * np.pi * h * phase)
    kind = rng.integers(0, 4, seg.max() + 1)[seg]  # 0,1: voiced, 2: fricative, 3: pause
    noise = np.diff(rng.standard_normal(n + 1))  # high-tilted noise, like /s/
    out = np.where(kind < 2, voiced / np.max(np.abs(voiced)), np.where(kind == 2, 0.15 * noise, 0.0))
    # 10 ms fades between phones so the signal has envelopes, not hard switches.
    ramp = np.minimum(1.0, np.minimum(t % 0.15, 0.15 - t % 0.15) / 0.01)
    return (0.3 * out * ramp).astype(np.float32), kind


def run_encoder(encoder: object, audio: np.ndarray, chunks: list[int] | None = None) -> list[EncodedFrame]:
    """Push ``audio`` in the given chunk sizes (cycled), then finish."""
    frames: list[EncodedFrame] = []
    sizes = chunks or [len(audio) or 1]
    pos = i = 0
    while pos < len(audio):
        step = sizes[i % len(sizes)]
        frames += encoder.push(audio[pos : pos + step])  # type: ignore[attr-defined]
        pos += step
        i += 1
    frames += encoder.finish()  # type: ignore[attr-defined]
    return frames


def decode_packets(packets: list[bytes], rate: int) -> np.ndarray:
    """Decode raw Opus packets in order with libopus at ``rate`` (float32)."""
    dec = opuslib.Decoder(rate, 1)
    n = rate * 120 // 1000  # the longest Opus packet, so any packet fits
    parts = [np.frombuffer(dec.decode_float(p, n), dtype=np.float32) for p in packets]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    """Waveform signal-to-noise ratio in dB."""
    ref = reference.astype(np.float64)
    err = ref - test.astype(np.float64)
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum(err**2), 1e-30)))


def best_lag(reference: np.ndarray, test: np.ndarray, max_lag: int = 400) -> int:
    """The shift of ``test`` against ``reference`` (within ±``max_lag``) that maximizes their correlation.

    FFT-based on purpose: many ``np.dot`` calls go through a multithreaded
    BLAS, which crawls on a CPU-starved CI machine.
    """
    n = len(reference) + len(test)
    spectrum = np.fft.rfft(test.astype(np.float64), n) * np.conj(np.fft.rfft(reference.astype(np.float64), n))
    corr = np.fft.irfft(spectrum, n)  # corr[lag] = sum_i reference[i] * test[i + lag], lag mod n
    lags = np.arange(-max_lag, max_lag + 1)
    return int(lags[np.argmax(corr[lags % n])])
