"""What one stream's encoder and resampler hold in memory: the memory budget's estimate (issue #42).

The state lives mostly in C (libopus, LAME, libFLAC, libsoxr), out of tracemalloc's sight, so
each figure is the growth of a process's RSS per encoder over 1000 live encoders of one format
and rate, each after 0.5 s of audio pushed through it (every lazily made buffer exists then),
or tracemalloc's count where that was larger, rounded up to KiB. Measured with
``python -m bench.studies.encoder_state --n 1000`` (each format and rate in a fresh process; x86-64,
Python 3.11, the locked package versions) on 2026-12-06. Rates other than 24 kHz include the
libsoxr resampler (``HQ``): about 128 KiB to 8 kHz, 135 KiB to 16 kHz, 207 KiB to 48 kHz.
An encoder the server builds with other options (bitrate, complexity) is within a few KiB.
Longer frames (a stream's ``frame_ms``, measured at 20) add what the encoder may hold of a
frame not yet whole: the frame's extra samples as float32.
"""

from __future__ import annotations

from typing import Final

_KIB: Final = 1024
#: Bytes of state per live encoder, by format, then by output rate (8, 16, 24, 48 kHz).
ENCODER_STATE_BYTES: Final[dict[str, dict[int, int]]] = {
    fmt: {rate: kib * _KIB for rate, kib in zip((8_000, 16_000, 24_000, 48_000), sizes, strict=True)}
    for fmt, sizes in {
        # Raw PCM keeps less than one 20 ms frame; the resampler is all the rest.
        "pcm16": (128, 135, 1, 207),
        "f32": (128, 135, 1, 207),
        "mulaw": (128, 135, 1, 207),
        "opus": (165, 181, 44, 240),
        "ogg": (165, 177, 44, 240),
        "mp3": (401, 544, 452, 735),
        "flac": (282, 369, 259, 574),
    }.items()
}
#: For a format or rate not measured: the largest figure of the table.
_LARGEST: Final = max(size for by_rate in ENCODER_STATE_BYTES.values() for size in by_rate.values())


def encoder_state_bytes(fmt: str, sample_rate: int, frame_ms: int = 20) -> int:
    """The memory one stream's encoder of ``fmt`` at ``sample_rate`` (and its resampler) holds.

    ``frame_ms``: its frames' length; the table was measured with 20 ms frames.
    """
    longer = max(0, frame_ms - 20) * sample_rate // 1000 * 4  # a partial frame's float32 samples
    return ENCODER_STATE_BYTES.get(fmt, {}).get(sample_rate, _LARGEST) + longer
