"""Audio output: framing, encoding and resampling per stream (no sockets, no model)."""

from __future__ import annotations

from server.audio.base import EncodedFrame, FrameEncoder
from server.audio.pcm import FRAME_MS, PcmEncoder

#: Formats the server can produce now; ``hello`` advertises exactly these.
SUPPORTED_FORMATS: tuple[str, ...] = ("pcm16", "f32")
#: Output sample rates the server can produce now.
SUPPORTED_RATES: tuple[int, ...] = (24_000,)


class UnsupportedAudio(ValueError):
    """The requested format or sample rate is not available."""


def make_encoder(fmt: str, sample_rate: int, native_rate: int = 24_000) -> FrameEncoder:
    """Build the stateful encoder for one stream.

    Raises:
        UnsupportedAudio: unknown format or rate.
    """
    if fmt not in SUPPORTED_FORMATS:
        raise UnsupportedAudio(f"format {fmt!r} is not supported; use one of {list(SUPPORTED_FORMATS)}")
    if sample_rate not in SUPPORTED_RATES or sample_rate != native_rate:
        raise UnsupportedAudio(
            f"sample_rate {sample_rate} is not supported; use one of {list(SUPPORTED_RATES)}"
        )
    return PcmEncoder(fmt=fmt, sample_rate=sample_rate)


__all__ = [
    "FRAME_MS",
    "SUPPORTED_FORMATS",
    "SUPPORTED_RATES",
    "EncodedFrame",
    "FrameEncoder",
    "PcmEncoder",
    "UnsupportedAudio",
    "make_encoder",
]
