"""Protocol v1 data: the 12-byte frame header, what a stream yields, the URL rules."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from chattts_stream_client.errors import ProtocolViolation

HEADER = struct.Struct("<BBHII")
FLAG_LAST = 0x01
FLAG_SEGMENT_START = 0x02
PATH = "/v1/stream"


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """The binary frame header (docs/protocol.md, Audio frames)."""

    flags: int
    slot: int
    seq: int
    sample: int

    @property
    def last(self) -> bool:
        """Flag bit 0: the stream's last frame."""
        return bool(self.flags & FLAG_LAST)


def parse_frame(raw: bytes) -> tuple[FrameHeader, bytes]:
    """Split a binary message into header and payload.

    Raises:
        ProtocolViolation: too short or an unknown version.
    """
    if len(raw) < HEADER.size:
        raise ProtocolViolation(f"binary frame of {len(raw)} bytes is shorter than its header")
    version, flags, slot, seq, sample = HEADER.unpack_from(raw)
    if version != 1:
        raise ProtocolViolation(f"frame version {version} is not 1")
    return FrameHeader(flags, slot, seq, sample), raw[HEADER.size :]


@dataclass(frozen=True, slots=True)
class Segment:
    """A text segment (sentence) that starts in a frame: for captions and highlighting.

    Attributes:
        text: the segment's text as sent (before number normalization).
        seq: the frame holding its first sample.
        sample: its first sample's offset from the stream start.
        index: its place among the stream's segments, 0, 1, ... (None from servers before it).
    """

    text: str
    seq: int
    sample: int
    index: int | None = None


@dataclass(frozen=True, slots=True)
class Word:
    """A spoken word and its samples (``start`` ≤ sample < ``end``, from the stream start).

    Streams started with ``word_timestamps=True`` get each segment's words no later than the
    chunk holding the segment's last sample (numbers as spoken: "3" is "three").
    """

    text: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class AudioChunk:
    """One audio frame of a stream, taken exactly once (resumes drop duplicates).

    Attributes:
        data: the payload in the stream's format (pcm16/f32/mulaw samples, one Opus
            packet, or the next bytes of an ogg/mp3/flac file).
        seq: 0, 1, 2, ... without gaps.
        sample: offset of the frame's first sample from the stream start (output rate).
        last: the stream's last frame.
        segments: text segments whose first sample lies in this frame.
        received_at: ``time.perf_counter()`` when the frame was read from the socket.
        words: words timed before this frame (``word_timestamps`` streams): a segment's
            words come with a chunk at or before the one holding its last sample.
    """

    data: bytes
    seq: int
    sample: int
    last: bool
    segments: tuple[Segment, ...]
    received_at: float
    words: tuple[Word, ...] = ()


@dataclass(frozen=True, slots=True)
class Done:
    """How a stream ended: ``reason`` (``complete``, ``cancelled``, ``error``), its last seq and length."""

    reason: str
    last_seq: int
    samples: int


def stream_url(url: str) -> str:
    """``ws(s)://host:port/v1/stream`` from a WebSocket URL, an http(s) origin or ``host:port``.

    Raises:
        ValueError: a scheme other than ws, wss, http, https.
    """
    if "://" not in url:
        url = f"ws://{url}"
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    if scheme not in ("ws", "wss"):
        raise ValueError(f"not a WebSocket or HTTP URL: {url!r}")
    path = parts.path if parts.path not in ("", "/") else PATH
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))
