"""Audio output: framing, encoding and resampling per stream (no sockets, no model)."""

from __future__ import annotations

from server.audio.base import EncodedFrame, FrameEncoder
from server.audio.flac import FlacEncoder
from server.audio.mp3 import DEFAULT_MP3_BITRATE, Mp3Encoder
from server.audio.ogg import DEFAULT_PAGE_MS, OggOpusEncoder
from server.audio.opus import DEFAULT_BITRATE, DEFAULT_COMPLEXITY, OpusEncoder
from server.audio.pcm import FRAME_LENGTHS_MS, FRAME_MS, PcmEncoder
from server.audio.resample import ResamplingEncoder, StreamResampler, resampled_length

#: Formats the server can produce; ``hello`` advertises exactly these.
SUPPORTED_FORMATS: tuple[str, ...] = ("pcm16", "f32", "opus", "ogg", "mp3", "flac", "mulaw")
#: Output sample rates the server can produce (24 kHz is native; the others are resampled).
#: 8 kHz is telephony's rate (``mulaw``), open to every format.
SUPPORTED_RATES: tuple[int, ...] = (8_000, 16_000, 24_000, 48_000)
#: Formats whose encoding costs enough CPU to belong off the event loop (see
#: bench/results/studies/opus-cost-epyc-2core.md and encoder-cost-epyc-2core.md); PCM framing is cheap
#: enough to stay inline. ``mulaw`` is a table lookup, but telephony asks for it
#: at 8 kHz, so it nearly always resamples.
CPU_HEAVY_FORMATS: frozenset[str] = frozenset({"opus", "ogg", "mp3", "flac", "mulaw"})
#: Formats whose wire frames have a fixed length a stream may choose (``frame_ms``); Ogg
#: (pages), MP3 and FLAC frame by their own containers.
FRAMED_FORMATS: frozenset[str] = frozenset({"pcm16", "f32", "mulaw", "opus"})


class UnsupportedAudio(ValueError):
    """The requested format or sample rate is not available."""


def make_encoder(
    fmt: str,
    sample_rate: int,
    native_rate: int = 24_000,
    *,
    opus_bitrate: int = DEFAULT_BITRATE,
    opus_complexity: int = DEFAULT_COMPLEXITY,
    ogg_page_ms: int = DEFAULT_PAGE_MS,
    ogg_serial: int | None = None,
    mp3_bitrate: int = DEFAULT_MP3_BITRATE,
    resample_quality: str = "HQ",
    frame_ms: int = FRAME_MS,
) -> FrameEncoder:
    """Build the stateful encoder for one stream.

    The encoder takes ``native_rate`` float32 chunks of any length and
    resamples them (statefully, no seams) when ``sample_rate`` differs; Opus
    encodes at ``sample_rate`` directly. Every returned frame's ``samples``
    is at ``sample_rate`` and a stream's frames sum to exactly
    ``resampled_length(n_native, native_rate, sample_rate)``.

    Args:
        fmt: one of :data:`SUPPORTED_FORMATS`.
        sample_rate: one of :data:`SUPPORTED_RATES`.
        native_rate: the engine's rate (24 kHz for ChatTTS).
        opus_bitrate: ``opus``/``ogg`` target bitrate in bit/s (default 32000).
        opus_complexity: ``opus``/``ogg`` libopus complexity 0..10 (default 5).
        ogg_page_ms: ``ogg`` longest audio per page in ms (default 100);
            partial pages are closed at the end of every push anyway.
        ogg_serial: ``ogg`` stream serial number; random per stream when ``None``.
        mp3_bitrate: ``mp3`` CBR bitrate in kbit/s (default 64).
        resample_quality: libsoxr preset (``QQ``, ``LQ``, ``MQ``, ``HQ``,
            ``VHQ``) when resampling; default ``HQ``.
        frame_ms: each wire frame's length, one of :data:`FRAME_LENGTHS_MS`; only the
            :data:`FRAMED_FORMATS` take another than 20.

    Raises:
        UnsupportedAudio: unknown format or rate.
        ValueError: an option is out of range.
    """
    if fmt not in SUPPORTED_FORMATS:
        raise UnsupportedAudio(f"format {fmt!r} is not supported; use one of {list(SUPPORTED_FORMATS)}")
    if sample_rate not in SUPPORTED_RATES:
        raise UnsupportedAudio(
            f"sample_rate {sample_rate} is not supported; use one of {list(SUPPORTED_RATES)}"
        )
    if frame_ms not in FRAME_LENGTHS_MS:
        raise UnsupportedAudio(f"frame_ms {frame_ms} is not supported; use one of {list(FRAME_LENGTHS_MS)}")
    if frame_ms != FRAME_MS and fmt not in FRAMED_FORMATS:
        raise UnsupportedAudio(
            f"frame_ms applies to {sorted(FRAMED_FORMATS)}; {fmt} frames by its own container (use 20)"
        )
    encoder: FrameEncoder
    if fmt == "opus":
        encoder = OpusEncoder(
            sample_rate, bitrate=opus_bitrate, complexity=opus_complexity, frame_ms=frame_ms
        )
    elif fmt == "ogg":
        encoder = OggOpusEncoder(
            sample_rate,
            bitrate=opus_bitrate,
            complexity=opus_complexity,
            page_ms=ogg_page_ms,
            serial=ogg_serial,
        )
    elif fmt == "mp3":
        encoder = Mp3Encoder(sample_rate, bitrate=mp3_bitrate)
    elif fmt == "flac":
        encoder = FlacEncoder(sample_rate)
    else:
        encoder = PcmEncoder(fmt=fmt, sample_rate=sample_rate, frame_ms=frame_ms)
    if sample_rate != native_rate:
        encoder = ResamplingEncoder(encoder, in_rate=native_rate, quality=resample_quality)
    return encoder


def frame_ms_of(encoder: FrameEncoder) -> int:
    """The length of ``encoder``'s frames in ms (a stream's ``frame_ms``; 20 for the self-framing formats)."""
    inner = encoder.inner if isinstance(encoder, ResamplingEncoder) else encoder
    if isinstance(inner, PcmEncoder):
        return inner.frame_ms
    return inner.stream.frame_ms if isinstance(inner, OpusEncoder) else FRAME_MS


def opus_preskip(encoder: FrameEncoder) -> int:
    """Decoded samples (at the output rate) a raw-Opus client drops at the stream start; 0 for other formats.

    For ``opus`` this is the libopus lookahead (156 at 24 kHz, 104 at 16 kHz,
    312 at 48 kHz: 6.5 ms), worth announcing in ``started`` so that clients
    need not know libopus internals; ``ogg`` carries it in its OpusHead and
    PCM has none.
    """
    inner = encoder.inner if isinstance(encoder, ResamplingEncoder) else encoder
    return inner.preskip if isinstance(inner, OpusEncoder) else 0


__all__ = [
    "CPU_HEAVY_FORMATS",
    "FRAMED_FORMATS",
    "FRAME_LENGTHS_MS",
    "FRAME_MS",
    "SUPPORTED_FORMATS",
    "SUPPORTED_RATES",
    "EncodedFrame",
    "FlacEncoder",
    "FrameEncoder",
    "Mp3Encoder",
    "OggOpusEncoder",
    "OpusEncoder",
    "PcmEncoder",
    "ResamplingEncoder",
    "StreamResampler",
    "UnsupportedAudio",
    "frame_ms_of",
    "make_encoder",
    "opus_preskip",
    "resampled_length",
]
