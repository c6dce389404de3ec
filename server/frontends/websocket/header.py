"""Wire protocol v1's binary half: the 12-byte header in front of every audio frame.

``version`` (1), ``flags`` (bit 0: the stream's last frame; bit 1: a text segment starts in
it), ``slot``, ``seq`` and ``sample``, little-endian (docs/protocol.md, "Audio frames").
Pure values: nothing here touches sockets.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from server.streams.items import Frame

PROTOCOL_VERSION: Final = 1
HEADER = struct.Struct("<BBHII")
HEADER_SIZE: Final = HEADER.size  # 12
FLAG_LAST: Final = 0x01
FLAG_SEGMENT_START: Final = 0x02


def frame(slot: int, item: Frame) -> bytes:
    """An audio frame with its 12-byte header, ready to send as one binary message."""
    flags = (FLAG_LAST if item.last else 0) | (FLAG_SEGMENT_START if item.segment_start else 0)
    return HEADER.pack(PROTOCOL_VERSION, flags, slot, item.position, item.sample) + item.payload


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """The 12-byte header in front of every binary audio frame."""

    flags: int
    slot: int
    seq: int
    sample: int
    version: int = PROTOCOL_VERSION

    @property
    def last(self) -> bool:
        """Whether this is the stream's last frame."""
        return bool(self.flags & FLAG_LAST)

    @property
    def segment_start(self) -> bool:
        """Whether a new text segment starts in this frame."""
        return bool(self.flags & FLAG_SEGMENT_START)


def unpack_frame(frame: bytes) -> tuple[FrameHeader, bytes]:
    """Split a binary message into its header and payload.

    Raises:
        ValueError: shorter than the header or an unknown version.
    """
    if len(frame) < HEADER_SIZE:
        raise ValueError(f"frame of {len(frame)} bytes is shorter than the {HEADER_SIZE}-byte header")
    version, flags, slot, seq, sample = HEADER.unpack_from(frame)
    if version != PROTOCOL_VERSION:
        raise ValueError(f"unknown frame version {version}")
    return FrameHeader(flags=flags, slot=slot, seq=seq, sample=sample, version=version), frame[HEADER_SIZE:]
