"""What one stream's outbox holds, in order: plain values in no wire format.

:class:`SegmentMark`, :class:`Frame` (seq, sample offset, payload), :class:`Words`,
:class:`Failure` and :class:`Done`; :mod:`server.streams.outbox` numbers and bounds them,
the front ends render them.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.core.events import EndReason
from server.errors import ServiceError


@dataclass(frozen=True, slots=True)
class Frame:
    """One audio frame: its seq (``position``), first sample offset at the output rate, payload."""

    position: int
    payload: bytes
    sample: int
    samples: int
    last: bool = False
    segment_start: bool = False


@dataclass(frozen=True, slots=True)
class SegmentMark:
    """Text segment ``index`` starts in the frame with seq ``position``, at output sample ``sample``."""

    position: int
    sample: int
    text: str
    index: int = 0


@dataclass(frozen=True, slots=True)
class WordSpan:
    """One spoken word and its samples, ``start`` ≤ sample < ``end``, from the stream start."""

    text: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Words:
    """The words of one text segment, timed; sent before the frame with seq ``position``.

    Streams that asked for word timestamps get one after each segment's :class:`SegmentMark`
    and before the frame that holds the segment's last sample.
    """

    position: int
    start: int  # the segment's first sample
    end: int  # one past its last sample
    words: tuple[WordSpan, ...]


@dataclass(frozen=True, slots=True)
class Failure:
    """The stream failed; a :class:`Done` with reason ``error`` follows."""

    position: int
    error: ServiceError


@dataclass(frozen=True, slots=True)
class Done:
    """The last item: why the stream ended, its last seq and its length in output samples."""

    position: int
    reason: EndReason
    last_seq: int
    samples: int


#: ``position``: a frame's seq; a mark's frame; ``Words``: the next frame's; ``Failure``/``Done``:
#: last seq + 1. A resume after seq ``n`` replays every item with ``position > n``.
OutItem = Frame | SegmentMark | Words | Failure | Done
