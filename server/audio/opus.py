"""Stateful Opus encoding per stream: one raw Opus packet (20, 40 or 60 ms) per wire frame.

Uses libopus through ``opuslib`` (ctypes; needs the system library, Debian
package ``libopus0``). Opus runs natively at 8/12/16/24/48 kHz, so the encoder
works at the stream's output rate and never resamples itself.

Pre-skip and sample accounting
------------------------------
libopus delays its output by the encoder *lookahead* ``L`` (156 samples at
24 kHz, 6.5 ms, with ``APPLICATION_AUDIO``): decoding packets ``0..P-1``
gives ``P·F`` samples (``F`` = one packet's samples, 20 ms by default) whose first ``L`` are the
encoder's warm-up, not stream audio. This is the same quantity as the Ogg
Opus "pre-skip" (RFC 7845), there expressed in 48 kHz units.

So that the listener gets exactly the stream's audio, no more, no less:

* At the end the last partial frame is zero-padded and just enough packets
  are emitted to flush the lookahead: ``P = ceil((N + L) / F)`` for a stream
  of ``N`` samples (always at least one packet, even for ``N = 0``, so the
  stream's last frame is a real, decodable packet).
* Each packet's ``samples`` is the number of *stream* samples it carries
  once the pre-skip is dropped and the zero padding cut: packet ``k`` covers
  the stream interval ``[k·F − L, (k+1)·F − L) ∩ [0, N)``. Hence packet 0
  carries ``F − L``, middle packets ``F``, the last ones the rest, and the
  sum over a stream is exactly ``N``. The wire ``sample`` offset of packet
  ``k`` is then ``max(0, k·F − L)``: where its first audible sample lies on
  the stream's timeline, the same timeline as PCM output.

Client rule (documented for the protocol): decode every packet in order,
drop the first ``L`` decoded samples of the stream (the first packet's first
``L``), keep ``samples`` samples of each packet (all of a middle packet, the
head of the last ones). ``L`` is :attr:`OpusStreamEncoder.preskip`; the first
packet's ``samples`` also reveals it as ``F − samples`` when ``N ≥ F − L``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import opuslib

from server.audio.base import EncodedFrame
from server.engine_api import AudioArray

#: Sample rates libopus encodes natively.
OPUS_RATES = (8_000, 12_000, 16_000, 24_000, 48_000)
FRAME_MS = 20  # the default packet; libopus also takes 40 and 60 ms (one call, fewer packets)
#: Default target bitrate (bit/s). Speech at 24 kHz sounds transparent-ish from
#: ~24 kbit/s; 32 kbit/s leaves headroom for the tonal/noisy parts of TTS output.
DEFAULT_BITRATE = 32_000
#: Default libopus complexity (0..10). See bench/results/studies/opus-cost-epyc-2core.md for
#: the measured cost of 5 vs 10 and the reason for this default.
DEFAULT_COMPLEXITY = 5
_EMPTY: AudioArray = np.zeros(0, dtype=np.float32)


@dataclass(frozen=True, slots=True)
class OpusPacket:
    """One raw Opus packet and the stream samples (at the encoder rate) a listener hears from it."""

    data: bytes
    samples: int


def libopus_version() -> str:
    """The loaded libopus version string, e.g. ``libopus 1.3.1``."""
    version: bytes = opuslib.api.info.get_version_string()
    return version.decode("ascii", "replace")


class OpusStreamEncoder:
    """Packetizes one mono stream into Opus packets of ``frame_ms`` with exact stream-end accounting.

    Not thread-safe; one instance per stream. The libopus calls release the
    GIL (ctypes), so an instance may be driven from a worker thread as long as
    its calls are not concurrent.
    """

    def __init__(
        self,
        sample_rate: int,
        *,
        bitrate: int = DEFAULT_BITRATE,
        complexity: int = DEFAULT_COMPLEXITY,
        frame_ms: int = FRAME_MS,
    ) -> None:
        """Create the libopus encoder.

        Args:
            sample_rate: one of :data:`OPUS_RATES`; the rate of the input and
                of the ``samples`` counts.
            bitrate: target bitrate in bit/s (libopus range 500..512000; VBR).
            complexity: libopus complexity 0..10 (CPU cost vs quality).
            frame_ms: each packet's length: 20, 40 or 60 ms (a longer packet is one libopus
                call and one wire frame for more audio; the pre-skip does not change).

        Raises:
            ValueError: unsupported rate, bitrate, complexity or packet length.
        """
        if sample_rate not in OPUS_RATES:
            raise ValueError(f"Opus cannot encode at {sample_rate} Hz; use one of {list(OPUS_RATES)}")
        if not 500 <= bitrate <= 512_000:
            raise ValueError(f"opus bitrate must be in 500..512000, got {bitrate}")
        if not 0 <= complexity <= 10:
            raise ValueError(f"opus complexity must be in 0..10, got {complexity}")
        if frame_ms not in (20, 40, 60):
            raise ValueError(f"opus frame_ms must be one of [20, 40, 60], got {frame_ms}")
        self.sample_rate = sample_rate
        self.bitrate = bitrate
        self.complexity = complexity
        self.frame_ms = frame_ms
        #: Samples per packet at ``sample_rate``.
        self.frame_samples = sample_rate * frame_ms // 1000
        self._enc = opuslib.Encoder(sample_rate, 1, opuslib.APPLICATION_AUDIO)
        self._enc.bitrate = bitrate
        self._enc.complexity = complexity
        self._preskip = int(self._enc.lookahead)
        self._pending: AudioArray = _EMPTY
        self._in_count = 0
        self._packets = 0
        self._finished = False

    @property
    def preskip(self) -> int:
        """Decoded samples (at ``sample_rate``) to drop at the stream start: the encoder lookahead."""
        return self._preskip

    @property
    def preskip_48k(self) -> int:
        """The pre-skip in 48 kHz units, as the OpusHead header wants it."""
        return self._preskip * 48_000 // self.sample_rate

    @property
    def packets(self) -> int:
        """Packets emitted so far."""
        return self._packets

    @property
    def input_samples(self) -> int:
        """Stream samples pushed so far (without the end padding)."""
        return self._in_count

    def _audible(self, k: int, total: int) -> int:
        # Stream interval of packet k after the pre-skip, cut at the stream end.
        f, lead = self.frame_samples, self._preskip
        start = min(max(k * f - lead, 0), total)
        end = min(max((k + 1) * f - lead, 0), total)
        return end - start

    def _encode(self, frames: AudioArray, total: int) -> list[OpusPacket]:
        n = self.frame_samples
        # Clip like pcm16 does: libopus accepts floats beyond ±1, but a decoder
        # would then hard-clip to int16 anyway, and the SNR tests compare to pcm16.
        frames = np.clip(frames, -1.0, 1.0).astype("<f4", copy=False)
        out: list[OpusPacket] = []
        for i in range(len(frames) // n):
            data = self._enc.encode_float(frames[i * n : (i + 1) * n].tobytes(), n)
            out.append(OpusPacket(data, self._audible(self._packets, total)))
            self._packets += 1
        return out

    def push(self, audio: AudioArray) -> list[OpusPacket]:
        """Buffer ``audio`` and encode every complete frame.

        Raises:
            RuntimeError: called after :meth:`finish`.
        """
        if self._finished:
            raise RuntimeError("push() after finish()")
        chunk = np.asarray(audio, dtype=np.float32).reshape(-1)
        self._in_count += len(chunk)
        pending = np.concatenate((self._pending, chunk)) if len(self._pending) else chunk
        full = len(pending) // self.frame_samples * self.frame_samples
        self._pending = pending[full:].copy()
        # Packets emitted during the stream end at or before the input seen so
        # far, so the stream length does not cut them: pass an upper bound.
        return self._encode(pending[:full], total=1 << 62)

    def finish(self) -> list[OpusPacket]:
        """Zero-pad and encode until the lookahead is flushed; at least one packet.

        Raises:
            RuntimeError: called twice.
        """
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        total = self._in_count
        needed = -(-(total + self._preskip) // self.frame_samples)  # ceil((N + L) / F)
        pad = needed * self.frame_samples - self._packets * self.frame_samples - len(self._pending)
        tail = np.concatenate((self._pending, np.zeros(pad, dtype=np.float32)))
        self._pending = _EMPTY
        return self._encode(tail, total=total)


class OpusEncoder:
    """The ``opus`` wire format: each :class:`EncodedFrame` payload is exactly one raw Opus packet.

    ``EncodedFrame.samples`` follows :class:`OpusStreamEncoder`'s accounting,
    so the ``sample`` header is the stream-timeline offset and the samples
    sum to the PCM length at the same rate.
    """

    def __init__(
        self,
        sample_rate: int,
        *,
        bitrate: int = DEFAULT_BITRATE,
        complexity: int = DEFAULT_COMPLEXITY,
        frame_ms: int = FRAME_MS,
    ) -> None:
        """See :class:`OpusStreamEncoder` for the arguments."""
        self.stream = OpusStreamEncoder(
            sample_rate, bitrate=bitrate, complexity=complexity, frame_ms=frame_ms
        )

    @property
    def format(self) -> str:
        """``opus``."""
        return "opus"

    @property
    def sample_rate(self) -> int:
        """The encoding (and output) rate."""
        return self.stream.sample_rate

    @property
    def preskip(self) -> int:
        """Decoded samples to drop at the stream start (see the module docstring)."""
        return self.stream.preskip

    def push(self, audio: AudioArray) -> list[EncodedFrame]:
        """Add samples at the output rate; one frame per completed packet."""
        return [EncodedFrame(p.data, p.samples) for p in self.stream.push(audio)]

    def finish(self) -> list[EncodedFrame]:
        """Pad and flush; returns at least one frame (a real packet, never an empty payload)."""
        return [EncodedFrame(p.data, p.samples) for p in self.stream.finish()]
