"""The ``flac`` wire format: a live FLAC stream (16-bit mono) through libsndfile (``soundfile``).

Why libsndfile: ``soundfile`` is a maintained binding whose wheels bundle
libsndfile with libFLAC, and libsndfile's FLAC writer hands each encoded
frame to its output as soon as libFLAC finishes it (one 4096-sample block,
170 ms at 24 kHz), so it streams. (``pyflac`` wraps libFLAC's stream encoder
too but has had no release since 2024; PyAV would bring all of FFmpeg.)

libsndfile writes to a file-like object and, when the file is closed, seeks
back to patch STREAMINFO (total samples, MD5, frame sizes). A stream cannot
take back bytes it has sent, so the output here is a forward-only sink:
bytes written at the end go out, the patches at earlier offsets are dropped.
The STREAMINFO that was sent keeps 0 in those fields, which the FLAC format
defines as "unknown" (what any live FLAC stream carries); decoders read the
frames normally. The first payload holds ``fLaC``, the metadata and the first
frame; concatenating all payloads gives a valid .flac file. libsndfile
(``soundfile``), though, cannot open a FLAC file of unknown length (it takes it
as 2^63 - 1 frames), so a sender that holds the whole file before sending it
(the HTTP API's complete response) writes the length in with
:func:`with_total_samples`; the frame sizes and MD5 stay "unknown", which every
decoder accepts (the length is what libsndfile needs).

Sample accounting: FLAC is lossless with no delay, so a frame's ``samples``
are the samples its complete FLAC frames hold (each wire frame carries what
libFLAC emitted during one push; libFLAC finishes block ``k`` once it has
sample ``k·4096 + 1``); the last one carries the rest.
"""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np
import soundfile

from server.audio.base import EncodedFrame
from server.audio.pcm import to_pcm16
from server.engine_api import AudioArray

#: libFLAC's default block size as libsndfile uses it: samples per FLAC frame.
FLAC_BLOCK = 4096


def empty_flac(sample_rate: int) -> bytes:
    """A FLAC file with no audio: the marker and a last-block STREAMINFO (16-bit mono, length 0)."""
    info = struct.pack(">HH", FLAC_BLOCK, FLAC_BLOCK) + bytes(6)  # block sizes; frame sizes unknown
    info += ((sample_rate << 44) | (0 << 41) | (15 << 36)).to_bytes(8, "big")  # rate, mono, 16 bit, 0
    info += bytes(16)  # MD5 unknown
    return b"fLaC" + bytes((0x80,)) + len(info).to_bytes(3, "big") + info


#: Where STREAMINFO's fields start: after ``fLaC`` and its 4-byte metadata block header.
_STREAMINFO_AT = 8
#: STREAMINFO's length in bytes (RFC 9639, section 8.2).
_STREAMINFO_BYTES = 34
#: STREAMINFO's total samples: the low 36 bits of the 8 bytes that start 10 bytes in.
_TOTAL_AT = _STREAMINFO_AT + 10
_TOTAL_BITS = 36
#: The bytes a FLAC file starts with up to STREAMINFO's end (what :func:`with_total_samples` needs).
FLAC_HEADER_BYTES = _STREAMINFO_AT + _STREAMINFO_BYTES


def with_total_samples(data: bytes, total_samples: int) -> bytes:
    """``data`` (a FLAC file's first bytes, or all of it) with STREAMINFO's total samples set.

    Only the 8 bytes that hold the field change; the rest is copied as it is.

    Raises:
        ValueError: ``data`` does not start with ``fLaC`` and a STREAMINFO block, or the
            length does not fit the field's 36 bits.
    """
    header = data[:FLAC_HEADER_BYTES]
    size = int.from_bytes(header[5:8], "big") if len(header) >= 8 else 0
    if len(header) < FLAC_HEADER_BYTES or header[:4] != b"fLaC" or header[4] & 0x7F != 0:
        raise ValueError("not a FLAC stream that starts with its STREAMINFO block")
    if size != _STREAMINFO_BYTES:
        raise ValueError(f"STREAMINFO is {size} bytes long, not {_STREAMINFO_BYTES}")
    if not 0 <= total_samples < 1 << _TOTAL_BITS:
        raise ValueError(f"{total_samples} samples do not fit FLAC's 36-bit length")
    field = int.from_bytes(data[_TOTAL_AT : _TOTAL_AT + 8], "big")
    field = field >> _TOTAL_BITS << _TOTAL_BITS | total_samples  # rate, channels, bits stay
    return data[:_TOTAL_AT] + field.to_bytes(8, "big") + data[_TOTAL_AT + 8 :]


class _ForwardSink(io.RawIOBase):
    """A write-only stream for libsndfile that keeps only bytes appended at the end."""

    def __init__(self) -> None:
        self._out = bytearray()
        self._pos = 0
        self._end = 0  # bytes handed out so far

    def readable(self) -> bool:
        return True  # libsndfile's virtual I/O wants read/seek/tell to exist

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._end}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:
        return b""  # nothing is read back when writing FLAC

    def write(self, data: Any) -> int:
        size = len(data)
        if self._pos == self._end:
            self._out += data
            self._end += size
        # else: a header patch at an offset already sent (see the module docstring)
        self._pos += size
        return size

    def take(self) -> bytes:
        """The bytes written since the last call."""
        out, self._out = bytes(self._out), bytearray()
        return out


class FlacEncoder:
    """The ``flac`` frame encoder: one wire frame per push that completes FLAC frames."""

    def __init__(self, sample_rate: int) -> None:
        """Open the libsndfile FLAC writer (16-bit mono) at ``sample_rate``."""
        self._sample_rate = sample_rate
        self._sink = _ForwardSink()
        self._file = soundfile.SoundFile(
            self._sink, "w", samplerate=sample_rate, channels=1, format="FLAC", subtype="PCM_16"
        )
        self._pushed = 0
        self._reported = 0
        self._finished = False

    @property
    def format(self) -> str:
        """``flac``."""
        return "flac"

    @property
    def sample_rate(self) -> int:
        """The output rate (FLAC stores it in STREAMINFO)."""
        return self._sample_rate

    def _frame(self, *, final: bool) -> list[EncodedFrame]:
        data = self._sink.take()
        # libFLAC encodes a block once it holds one sample more than the block (it must
        # know the block is not the stream's last): whole blocks before the newest sample are out.
        audible = self._pushed if final else max(0, self._pushed - 1) // FLAC_BLOCK * FLAC_BLOCK
        samples, self._reported = audible - self._reported, audible
        return [EncodedFrame(data, samples)] if data or final else []

    def push(self, audio: AudioArray) -> list[EncodedFrame]:
        """Encode ``audio`` (at the output rate); one frame holding the FLAC frames completed now, if any.

        Raises:
            RuntimeError: called after :meth:`finish`.
        """
        if self._finished:
            raise RuntimeError("push() after finish()")
        pcm = to_pcm16(np.asarray(audio, dtype=np.float32).reshape(-1))
        self._pushed += len(pcm)
        self._file.write(pcm)
        return self._frame(final=False)

    def finish(self) -> list[EncodedFrame]:
        """Encode the last partial block; the last frame carries it (and the remaining samples).

        Raises:
            RuntimeError: called twice.
        """
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        self._file.close()
        if self._pushed == 0:  # libsndfile writes nothing for no samples; a stream still needs its header
            return [EncodedFrame(empty_flac(self._sample_rate), 0)]
        return self._frame(final=True)
