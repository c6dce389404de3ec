"""Raw PCM framing: fixed frames (20 ms by default) of signed 16-bit, float32 or μ-law samples."""

from __future__ import annotations

import numpy as np

from server.audio.base import EncodedFrame
from server.audio.mulaw import to_mulaw
from server.engine_api import AudioArray

#: The wire's frame length unless a stream's ``start`` asks for another (``frame_ms``).
FRAME_MS = 20
#: The frame lengths a stream may ask for: Opus's own packet lengths of 20 ms and more, so
#: that one ``frame_ms`` means the same for every format that takes it.
FRAME_LENGTHS_MS: tuple[int, ...] = (20, 40, 60)


class PcmEncoder:
    """Cuts audio into fixed frames of ``frame_ms``; only the stream's last frame is shorter."""

    def __init__(self, *, fmt: str, sample_rate: int, frame_ms: int = FRAME_MS) -> None:
        if fmt not in ("pcm16", "f32", "mulaw"):
            raise ValueError(f"not a PCM format: {fmt}")
        if frame_ms not in FRAME_LENGTHS_MS:
            raise ValueError(f"frame_ms must be one of {list(FRAME_LENGTHS_MS)}, got {frame_ms}")
        self._format = fmt
        self._sample_rate = sample_rate
        self.frame_ms = frame_ms
        self.frame_samples = sample_rate * frame_ms // 1000
        self._pending: AudioArray = np.zeros(0, dtype=np.float32)

    @property
    def format(self) -> str:
        """``pcm16``, ``f32`` or ``mulaw``."""
        return self._format

    @property
    def sample_rate(self) -> int:
        """Output rate (no resampling happens here)."""
        return self._sample_rate

    def _payload(self, samples: AudioArray) -> bytes:
        if self._format == "f32":
            return samples.astype("<f4").tobytes()
        if self._format == "mulaw":
            return to_mulaw(to_pcm16(samples))
        return to_pcm16(samples).tobytes()

    def push(self, audio: AudioArray) -> list[EncodedFrame]:
        """Buffer ``audio`` and return every full frame."""
        pending = np.concatenate((self._pending, audio.astype(np.float32, copy=False)))
        n = self.frame_samples
        full = len(pending) // n
        # One conversion for every full frame, then the bytes cut: the conversion is elementwise,
        # so the frames are the same as one conversion each, without numpy's cost per call.
        data = self._payload(pending[: full * n])
        width = len(data) // (full * n) if full else 0
        step = n * width
        frames = [EncodedFrame(data[i * step : (i + 1) * step], n) for i in range(full)]
        # A copy: a view of the remainder would keep this whole chunk alive until the next push.
        self._pending = pending[full * n :].copy()
        return frames

    def finish(self) -> list[EncodedFrame]:
        """Return the trailing partial frame (possibly empty: it still marks the end)."""
        rest = self._pending
        self._pending = np.zeros(0, dtype=np.float32)
        return [EncodedFrame(self._payload(rest), len(rest))]


def to_pcm16(samples: AudioArray) -> np.ndarray:
    """Float [-1, 1] to little-endian int16 with clipping and rounding (the wire's definition)."""
    scaled = np.clip(np.rint(samples.astype(np.float64) * 32767.0), -32768, 32767)
    return scaled.astype("<i2")
