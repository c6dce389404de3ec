"""The per-stream audio encoder interface shared by every output format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from server.engine_api import AudioArray


@dataclass(frozen=True, slots=True)
class EncodedFrame:
    """One binary frame's payload and how many output samples it stands for.

    ``samples`` counts samples at the stream's output rate that the listener
    will hear from this frame, so summing them gives each frame's ``sample``
    offset in the wire header.
    """

    payload: bytes
    samples: int


class FrameEncoder(Protocol):
    """Turns native-rate float32 audio chunks into wire frames, statefully.

    One instance per stream; not thread-safe. Chunks may have any length;
    the encoder buffers what does not fill a frame.
    """

    @property
    def format(self) -> str:
        """The protocol format name (``pcm16``, ``f32``, ``opus``, ``ogg``)."""
        ...

    @property
    def sample_rate(self) -> int:
        """The output sample rate the ``samples`` counts refer to."""
        ...

    def push(self, audio: AudioArray) -> list[EncodedFrame]:
        """Add native-rate samples; return every frame that is now complete."""
        ...

    def finish(self) -> list[EncodedFrame]:
        """End the stream: return the remaining frames (the last may be short or empty)."""
        ...
