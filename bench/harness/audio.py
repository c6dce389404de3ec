"""Client-side audio decoding: frame payloads to int16 samples, and the first non-silent sample.

A stream's timings need its samples only until the first non-silent one; after that the
harness counts each frame's samples without decoding it (:meth:`PayloadDecoder.count`). An
Opus decode costs about as much CPU as the server's encode, and the load client shares the
machine with the server it measures.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt

Int16Array = npt.NDArray[np.int16]

#: A sample counts as non-silent at or above this magnitude (about -60 dBFS).
DEFAULT_SILENCE_THRESHOLD = 33

#: Formats the harness can decode (``f32``/``ogg`` are not measured).
DECODABLE_FORMATS = ("pcm16", "opus")


class PayloadDecoder(Protocol):
    """Turns one audio frame payload into int16 samples at the stream's rate."""

    def decode(self, payload: bytes) -> Int16Array:
        """Samples of one frame (empty for an empty payload)."""
        ...

    def count(self, payload: bytes) -> int:
        """How many samples :meth:`decode` would give, without decoding."""
        ...


class Pcm16Decoder:
    """``pcm16`` payloads are already little-endian int16 samples."""

    def decode(self, payload: bytes) -> Int16Array:
        """Reinterpret the payload bytes."""
        return np.frombuffer(payload, dtype="<i2").astype(np.int16, copy=False)

    def count(self, payload: bytes) -> int:
        """Two bytes a sample."""
        return len(payload) // 2


class OpusDecoder:
    """One libopus decoder per stream (``opuslib``); each payload is one 20 ms packet."""

    def __init__(self, sample_rate: int, frame_ms: int = 20) -> None:
        import opuslib

        self._decoder = opuslib.Decoder(sample_rate, 1)
        self._rate = sample_rate
        # Room for the longest Opus packet (120 ms), whatever frame size the server uses.
        self._max_samples = sample_rate * 120 // 1000
        self.frame_samples = sample_rate * frame_ms // 1000

    def decode(self, payload: bytes) -> Int16Array:
        """Decode one packet (the empty last-frame payload decodes to nothing)."""
        if not payload:
            return np.zeros(0, dtype=np.int16)
        pcm = self._decoder.decode(payload, self._max_samples)
        return np.frombuffer(pcm, dtype="<i2").astype(np.int16, copy=False)

    def count(self, payload: bytes) -> int:
        """The packet's frames times their length, from its TOC byte (RFC 6716, section 3.1)."""
        if not payload:
            return 0
        toc = payload[0]
        config = toc >> 3
        if config < 12:  # SILK-only: 10, 20, 40, 60 ms
            tenths_ms = (100, 200, 400, 600)[config % 4]
        elif config < 16:  # hybrid: 10, 20 ms
            tenths_ms = (100, 200)[config % 2]
        else:  # CELT-only: 2.5, 5, 10, 20 ms
            tenths_ms = (25, 50, 100, 200)[config % 4]
        code = toc & 3
        frames = 1 if code == 0 else 2 if code < 3 else payload[1] & 0x3F
        return frames * self._rate * tenths_ms // 10_000


def make_decoder(fmt: str, sample_rate: int, frame_ms: int = 20) -> PayloadDecoder:
    """A decoder for ``fmt`` (one of :data:`DECODABLE_FORMATS`).

    Raises:
        ValueError: the format is not decodable here.
    """
    if fmt == "pcm16":
        return Pcm16Decoder()
    if fmt == "opus":
        return OpusDecoder(sample_rate, frame_ms)
    raise ValueError(f"cannot decode format {fmt!r}; choose from {', '.join(DECODABLE_FORMATS)}")


def first_loud_index(samples: Int16Array, threshold: int = DEFAULT_SILENCE_THRESHOLD) -> int | None:
    """Index of the first sample with ``|x| >= threshold``, or ``None``."""
    if samples.size == 0:
        return None
    loud = np.flatnonzero(np.abs(samples.astype(np.int32)) >= threshold)
    return int(loud[0]) if loud.size else None
