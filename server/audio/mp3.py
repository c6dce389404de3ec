"""The ``mp3`` wire format: MPEG Layer III through LAME (``lameenc``), streamed as frames complete.

``lameenc`` (a maintained binding that bundles LAME 3.100) returns whatever
whole frames LAME has finished after each push; nothing waits for the end of
the stream. The stream is CBR at ``bitrate`` kbit/s: MPEG-2 Layer III (576
samples per frame) at 16 and 24 kHz, MPEG-1 (1152) at 48 kHz, MPEG-2.5 (576)
at 8 kHz.

Gapless start
-------------
An MP3 decoder's output lags the input by LAME's encoder delay (576 samples)
plus the decoder's own delay (529), and the last frame is padded. A streamed
file cannot carry the usual Xing/LAME header with the frame count (it is only
known at the end), but it can carry one *without* it: the first payload starts
with a LAME "Info" frame (a silent frame that holds the tag) giving the
encoder delay, so libmpg123 (libsndfile, soundfile), ffmpeg and browsers drop
the 1105 warm-up samples and the decoded audio starts exactly at the stream's
first sample. The padding field is 0 (unknown when the tag is sent), so the
decoded length exceeds the stream's by less than one frame (the tail of the
last frame). ffmpeg, which only skips the tag frame when it also carries a
frame count, decodes it as one frame of silence before the audio.

Sample accounting
-----------------
Like the ``opus`` format, each wire frame's ``samples`` counts the stream
samples a gapless decoder can output once it has that payload: after ``K``
complete MPEG frames that is ``clamp(K·F − 1105, 0, pushed)``, and the last
wire frame carries the rest, so the frames of a stream sum to exactly its PCM
length and each frame's ``sample`` header is on the PCM timeline.
"""

from __future__ import annotations

import struct

import lameenc
import numpy as np

from server.audio.base import EncodedFrame
from server.audio.pcm import to_pcm16
from server.engine_api import AudioArray

#: Rates this encoder produces (no resampling inside LAME: the stream is resampled before).
MP3_RATES = (8_000, 16_000, 24_000, 48_000)
#: Default CBR bitrate in kbit/s: transparent-ish speech at 24 kHz mono.
DEFAULT_MP3_BITRATE = 64
#: LAME's algorithmic quality 0 (best, slowest) .. 9 (fastest); 5 is LAME's "good" default.
DEFAULT_MP3_QUALITY = 5
#: LAME's encoder delay and the standard MP3 decoder delay, in samples (LAME's ENCDELAY, 528 + 1).
ENCODER_DELAY = 576
DECODER_DELAY = 529
_VERSION_BITS = {8_000: 0b00, 16_000: 0b10, 24_000: 0b10, 48_000: 0b11}  # MPEG-2.5, 2, 2, 1
_RATE_INDEX = {8_000: 2, 16_000: 2, 24_000: 1, 48_000: 1}
_KBPS_V1 = (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)
_KBPS_V2 = (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)
_RATES_BY_BITS = {
    0b11: (44_100, 48_000, 32_000),
    0b10: (22_050, 24_000, 16_000),
    0b00: (11_025, 12_000, 8_000),
}


def frame_samples(sample_rate: int) -> int:
    """Samples per MPEG Layer III frame: 1152 for MPEG-1 rates (32 kHz and up), else 576."""
    return 1152 if sample_rate >= 32_000 else 576


def mp3_bitrates(sample_rate: int) -> tuple[int, ...]:
    """The CBR bitrates (kbit/s) MPEG Layer III allows at ``sample_rate``."""
    return (_KBPS_V1 if sample_rate >= 32_000 else _KBPS_V2)[1:]


def _crc16(data: bytes) -> int:
    # CRC-16/ARC (reflected 0x8005, init 0): the LAME tag's checksum.
    crc = 0
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0xA001 if crc & 1 else crc >> 1
    return crc


def _header(sample_rate: int, bitrate_index: int) -> bytes:
    version = _VERSION_BITS[sample_rate]
    # sync(11) version(2) layer III(01) no-CRC(1) | bitrate(4) rate(2) pad(0) private(0)
    # | mono(11) mode-ext(00) copyright(0) original(1) emphasis(00)
    word = (0x7FF << 21) | (version << 19) | (0b01 << 17) | (1 << 16)
    word |= (bitrate_index << 12) | (_RATE_INDEX[sample_rate] << 10) | (0b11 << 6) | (1 << 2)
    return struct.pack(">I", word)


def _frame_bytes(version: int, bitrate_index: int, rate_index: int, padding: int) -> int:
    rate = _RATES_BY_BITS[version][rate_index]
    if version == 0b11:
        return 144_000 * _KBPS_V1[bitrate_index] // rate + padding
    return 72_000 * _KBPS_V2[bitrate_index] // rate + padding


def info_frame(sample_rate: int, delay: int = ENCODER_DELAY) -> bytes:
    """A silent MPEG frame holding a LAME "Info" tag with the encoder delay (padding and frame count unknown).

    The frame's bitrate is the lowest that leaves room for the 192 bytes over
    which the tag's CRC runs, whatever the stream's own bitrate is.
    """
    version = _VERSION_BITS[sample_rate]
    table = _KBPS_V1 if version == 0b11 else _KBPS_V2
    index = next(
        i for i in range(1, len(table)) if _frame_bytes(version, i, _RATE_INDEX[sample_rate], 0) >= 192
    )
    size = _frame_bytes(version, index, _RATE_INDEX[sample_rate], 0)
    side_info = 17 if version == 0b11 else 9  # mono
    tag = bytearray(b"Info" + struct.pack(">I", 0))  # no frames/bytes/TOC/quality fields
    tag += b"LAME3.100"  # the encoder that produced the frames
    tag += bytes((0x00, 0x00))  # tag revision 0 + CBR method; lowpass unknown
    tag += bytes(4 + 2 + 2)  # peak, radio and audiophile replay gain: unset
    tag += bytes((0x00, 0x00))  # encoding flags + ATH type; bitrate
    tag += ((delay & 0xFFF) << 12).to_bytes(3, "big")  # encoder delay | padding 0 (unknown when sent)
    tag += bytes(1 + 1 + 2 + 4 + 2)  # misc, MP3 gain, preset/surround, music length, music CRC
    frame = bytearray(_header(sample_rate, index) + bytes(side_info) + tag)
    frame += bytes(190 - len(frame))
    frame += struct.pack(">H", _crc16(bytes(frame)))
    frame += bytes(size - len(frame))
    return bytes(frame)


class _FrameCounter:
    """Counts complete MPEG frames in a byte stream delivered in arbitrary pieces.

    Holds at most one incomplete frame's bytes (under 1.5 KB).
    """

    def __init__(self) -> None:
        self.frames = 0
        self._tail = b""  # the start of a frame not complete yet

    def feed(self, data: bytes) -> None:
        """Account for the next ``data`` bytes of the stream.

        Raises:
            ValueError: the bytes are not a sequence of MPEG audio frames.
        """
        data = self._tail + data
        pos = 0
        while len(data) - pos >= 4:
            b1, b2 = data[pos + 1], data[pos + 2]
            if data[pos] != 0xFF or b1 & 0xE0 != 0xE0 or b2 >> 4 in (0, 15) or (b2 >> 2) & 3 == 3:
                raise ValueError("LAME output is not on an MPEG frame boundary")
            size = _frame_bytes((b1 >> 3) & 0b11, b2 >> 4, (b2 >> 2) & 0b11, (b2 >> 1) & 1)
            if pos + size > len(data):
                break
            self.frames += 1
            pos += size
        self._tail = data[pos:]


class Mp3Encoder:
    """The ``mp3`` frame encoder: one wire frame per push that completes MPEG frames."""

    def __init__(
        self, sample_rate: int, *, bitrate: int = DEFAULT_MP3_BITRATE, quality: int = DEFAULT_MP3_QUALITY
    ) -> None:
        """Create the LAME encoder.

        Args:
            sample_rate: one of :data:`MP3_RATES`; input and output rate.
            bitrate: CBR bitrate in kbit/s, one of :func:`mp3_bitrates` for the rate.
            quality: LAME's quality 0 (best) .. 9 (fastest).

        Raises:
            ValueError: unsupported rate, bitrate or quality.
        """
        if sample_rate not in MP3_RATES:
            raise ValueError(f"mp3 cannot encode at {sample_rate} Hz; use one of {list(MP3_RATES)}")
        if bitrate not in mp3_bitrates(sample_rate):
            allowed = list(mp3_bitrates(sample_rate))
            raise ValueError(f"mp3 bitrate at {sample_rate} Hz must be one of {allowed} kbit/s")
        if not 0 <= quality <= 9:
            raise ValueError(f"mp3 quality must be in 0..9, got {quality}")
        self._sample_rate = sample_rate
        self.bitrate = bitrate
        self.frame_samples = frame_samples(sample_rate)
        self._lame = lameenc.Encoder()
        self._lame.set_in_sample_rate(sample_rate)
        self._lame.set_out_sample_rate(sample_rate)
        self._lame.set_channels(1)
        self._lame.set_bit_rate(bitrate)
        self._lame.set_quality(quality)
        self._counter = _FrameCounter()
        self._header: bytes | None = info_frame(sample_rate)
        self._pushed = 0
        self._reported = 0
        self._finished = False

    @property
    def format(self) -> str:
        """``mp3``."""
        return "mp3"

    @property
    def sample_rate(self) -> int:
        """The encoding (and output) rate."""
        return self._sample_rate

    def _frame(self, data: bytes, *, final: bool) -> list[EncodedFrame]:
        self._counter.feed(data)
        lead = ENCODER_DELAY + DECODER_DELAY
        decodable = max(0, self._counter.frames * self.frame_samples - lead)
        audible = self._pushed if final else min(self._pushed, decodable)
        samples, self._reported = audible - self._reported, audible
        if self._header is not None and (data or final):
            data, self._header = self._header + data, None
        return [EncodedFrame(data, samples)] if data or final else []

    def push(self, audio: AudioArray) -> list[EncodedFrame]:
        """Encode ``audio`` (at the output rate); one frame holding every MPEG frame completed now, if any.

        Raises:
            RuntimeError: called after :meth:`finish`.
        """
        if self._finished:
            raise RuntimeError("push() after finish()")
        pcm = to_pcm16(np.asarray(audio, dtype=np.float32).reshape(-1))
        self._pushed += len(pcm)
        return self._frame(bytes(self._lame.encode(pcm.tobytes())), final=False)

    def finish(self) -> list[EncodedFrame]:
        """Flush LAME; the last frame carries the remaining MPEG frames and samples.

        Raises:
            RuntimeError: called twice.
        """
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        head = bytes(self._lame.encode(b""))  # lameenc only flushes an encoder that has started
        return self._frame(head + bytes(self._lame.flush()), final=True)
