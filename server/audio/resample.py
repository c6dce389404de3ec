"""Stateful sample-rate conversion for streams (libsoxr through the ``soxr`` package).

The engine produces audio at its native rate (24 kHz) in chunks of arbitrary
length. Resampling each chunk on its own would put a seam at every chunk
boundary (each call starts and ends its filter from silence), so every stream
gets one :class:`StreamResampler` that keeps the filter state across chunks
(``soxr.ResampleStream``). Its output equals one-shot resampling of the whole
stream (``soxr.resample``), sample for sample in practice (see the unit tests).

Length contract: a stream of ``n`` input samples yields exactly
:func:`resampled_length` ``(n, in_rate, out_rate)`` output samples, i.e.
``floor(n * out_rate / in_rate + 1/2)``, what libsoxr itself produces; the
class enforces it at :meth:`StreamResampler.finish` so that callers can rely
on it. For 24 kHz to 48 kHz that is ``2n``; to 16 kHz it is ``round(2n/3)``.

Latency: the filter holds back a few milliseconds of output until more input
(or the end) arrives; with the default ``HQ`` quality about 16 ms at 16 kHz
and 27 ms at 48 kHz. Nothing is lost: :meth:`StreamResampler.finish` releases it.
"""

from __future__ import annotations

import numpy as np
import soxr

from server.audio.base import EncodedFrame, FrameEncoder
from server.engine_api import AudioArray

#: libsoxr quality presets accepted by :class:`StreamResampler`.
RESAMPLE_QUALITIES = ("QQ", "LQ", "MQ", "HQ", "VHQ")
_EMPTY: AudioArray = np.zeros(0, dtype=np.float32)


def resampled_length(n: int, in_rate: int, out_rate: int) -> int:
    """Output length for ``n`` input samples: ``floor(n * out_rate / in_rate + 1/2)`` (exact integers)."""
    return (2 * n * out_rate + in_rate) // (2 * in_rate)


class StreamResampler:
    """Resamples one mono float32 stream chunk by chunk without seams.

    Not thread-safe; one instance per stream. When the two rates are equal it
    passes audio through untouched (no filter, no delay).
    """

    def __init__(self, in_rate: int, out_rate: int, *, quality: str = "HQ") -> None:
        """Create the resampler.

        Args:
            in_rate: input sample rate in Hz.
            out_rate: output sample rate in Hz.
            quality: libsoxr preset, one of :data:`RESAMPLE_QUALITIES`. ``HQ``
                (the default) is libsoxr's own default: 20-bit precision, a
                passband to 91% of the lower Nyquist frequency.

        Raises:
            ValueError: a rate is not positive or the quality is unknown.
        """
        if in_rate <= 0 or out_rate <= 0:
            raise ValueError(f"sample rates must be positive, got {in_rate} -> {out_rate}")
        if quality not in RESAMPLE_QUALITIES:
            raise ValueError(f"unknown resample quality {quality!r}; use one of {list(RESAMPLE_QUALITIES)}")
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._stream = (
            None if in_rate == out_rate else soxr.ResampleStream(in_rate, out_rate, 1, "float32", quality)
        )
        self._in_count = 0
        self._out_count = 0
        self._finished = False

    @property
    def input_samples(self) -> int:
        """Input samples pushed so far."""
        return self._in_count

    @property
    def output_samples(self) -> int:
        """Output samples returned so far."""
        return self._out_count

    def push(self, audio: AudioArray) -> AudioArray:
        """Add input samples and return the output that is ready now (possibly empty).

        Raises:
            RuntimeError: called after :meth:`finish`.
        """
        if self._finished:
            raise RuntimeError("push() after finish()")
        chunk = np.ascontiguousarray(audio, dtype=np.float32).reshape(-1)
        self._in_count += len(chunk)
        if self._stream is None:
            out = chunk
        elif len(chunk) == 0:
            return _EMPTY
        else:
            out = self._stream.resample_chunk(chunk, last=False).astype(np.float32, copy=False)
        self._out_count += len(out)
        return out

    def finish(self) -> AudioArray:
        """Flush the filter and return the stream's remaining output.

        The total output is then exactly :func:`resampled_length` of the input
        (libsoxr already gives that; the check guards against a future change
        of its rounding, so that ``sample`` offsets stay predictable).

        Raises:
            RuntimeError: called twice.
        """
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        tail = _EMPTY
        if self._stream is not None:
            tail = self._stream.resample_chunk(_EMPTY, last=True).astype(np.float32, copy=False)
        want = resampled_length(self._in_count, self.in_rate, self.out_rate) - self._out_count
        if len(tail) > want:
            tail = tail[: max(want, 0)]
        elif len(tail) < want:
            tail = np.concatenate((tail, np.zeros(want - len(tail), dtype=np.float32)))
        self._out_count += len(tail)
        return tail


class ResamplingEncoder:
    """A :class:`~server.audio.base.FrameEncoder` that resamples, then frames/encodes at the output rate.

    ``inner`` must run at ``out_rate``; its ``samples`` counts are then at the
    output rate, as the wire's ``sample`` header requires.
    """

    def __init__(self, inner: FrameEncoder, *, in_rate: int, quality: str = "HQ") -> None:
        """Wrap ``inner`` (which runs at the output rate) behind a resampler from ``in_rate``."""
        self._inner = inner
        self._resampler = StreamResampler(in_rate, inner.sample_rate, quality=quality)

    @property
    def format(self) -> str:
        """The inner encoder's format."""
        return self._inner.format

    @property
    def sample_rate(self) -> int:
        """The output rate (the inner encoder's)."""
        return self._inner.sample_rate

    @property
    def inner(self) -> FrameEncoder:
        """The wrapped encoder (for format-specific details such as the Opus pre-skip)."""
        return self._inner

    def push(self, audio: AudioArray) -> list[EncodedFrame]:
        """Resample ``audio`` and return the frames completed by it."""
        out = self._resampler.push(audio)
        return self._inner.push(out) if len(out) else []

    def finish(self) -> list[EncodedFrame]:
        """Flush the resampler into the encoder, then finish the encoder."""
        frames = self._inner.push(self._resampler.finish())
        return frames + self._inner.finish()
