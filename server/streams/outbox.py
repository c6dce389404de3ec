"""One stream's output in order, numbered and bounded: what every front end reads and replays.

An :class:`Outbox` turns a stream's encoded frames, segment starts and end
into the ordered items a client must receive: :class:`SegmentMark`,
:class:`Frame` (seq, sample offset, payload), :class:`Failure` and
:class:`Done`. They are plain values in no wire format (the front ends render
them). The items stay in a bounded replay buffer, so that a sender can fall
behind and a client that reconnects can resume from any seq still held.
No sockets, no model, no encoder here.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from server.audio.base import EncodedFrame
from server.core.events import EndReason
from server.engine_api import NATIVE_SAMPLE_RATE
from server.errors import ResumeExpired, ServiceError


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


#: ``position``: a frame's seq; a mark's frame; ``Failure``/``Done``: last seq + 1. A resume
#: after seq ``n`` replays every item with ``position > n``.
OutItem = Frame | SegmentMark | Failure | Done


class BufferOverflow(Exception):
    """More unsent audio piled up than allowed while attached (the reader is too slow)."""


class Outbox:
    """Numbering and buffering of one stream's output (event-loop side, no I/O).

    Memory is bounded twice: while ``attached``, more than ``max_unsent_s`` of
    audio not yet handed to the socket raises :class:`BufferOverflow`; and
    items beyond ``replay_max_s`` seconds of audio or ``replay_max_bytes``
    bytes are evicted oldest first, never one the attached sender has not
    sent yet.
    """

    def __init__(
        self, *, sample_rate: int, max_unsent_s: float, replay_max_s: float, replay_max_bytes: int
    ) -> None:
        self.sample_rate = sample_rate
        self._items: deque[OutItem] = deque()
        self._base = 0  # absolute index of self._items[0]
        self._held_bytes = 0
        self._held_samples = 0
        self._evicted_position = -1  # highest position evicted so far
        self._next_seq = 0
        self._next_sample = 0  # output samples numbered so far
        self._native_in = 0  # native samples received so far
        self._marks: deque[tuple[int, str]] = deque()  # (output sample offset, text)
        self._segments = 0  # the index of the next segment
        self._max_unsent_samples = int(max_unsent_s * sample_rate)
        self._replay_max_samples = int(replay_max_s * sample_rate)
        self._replay_max_bytes = replay_max_bytes
        self.done_reason: EndReason | None = None
        self.changed = asyncio.Event()
        #: A sender is attached: its unsent items are never evicted, and it may overflow.
        self.attached = True
        self.sent_index = 0  # absolute index of the next item the attached sender sends
        self._sent_samples = 0
        self._skip_through = -1  # a regenerated stream: items up to this seq are never held

    def start_at(self, *, seq: int, sample: int, native: int, skip_through: int, segment: int = 0) -> None:
        """Number a regenerated stream from its middle, and drop what the client has.

        Its next frame is ``seq`` at output ``sample``, ``native`` native samples came
        before, its next segment is ``segment``, and items with a seq up to ``skip_through``
        are dropped as they come (``Done`` never is).

        A resume before ``skip_through`` then answers ``ResumeExpired``, and nothing of this
        stream goes into the response cache.
        """
        self._next_seq, self._next_sample, self._native_in = seq, sample, native
        self._segments = segment
        self._sent_samples = sample
        self._skip_through = skip_through
        self._evicted_position = max(self._evicted_position, skip_through)

    # --- producing -----------------------------------------------------------

    @property
    def ended(self) -> bool:
        """``Done`` has been queued: nothing more will be added."""
        return self.done_reason is not None

    @property
    def start_index(self) -> int:
        """Absolute index of the oldest item still held."""
        return self._base

    @property
    def end_index(self) -> int:
        """Absolute index one past the last item."""
        return self._base + len(self._items)

    @property
    def held_bytes(self) -> int:
        """Payload bytes in the replay buffer (the bounded quantity)."""
        return self._held_bytes

    def on_segment(self, text: str) -> None:
        """A new text segment starts with the next native sample."""
        offset = self._native_in * self.sample_rate // NATIVE_SAMPLE_RATE
        self._marks.append((offset, text))

    def on_frames(self, frames: list[EncodedFrame], native_samples: int) -> None:
        """Number frames encoded from ``native_samples`` more native-rate samples.

        Raises:
            BufferOverflow: attached, and more than ``max_unsent_s`` waits to be sent.
        """
        self._native_in += native_samples
        self._add_frames(frames, last=False)
        self._evict()
        if self.attached and self.unsent_samples > self._max_unsent_samples:
            raise BufferOverflow

    def finish(
        self, reason: EndReason, final_frames: list[EncodedFrame], error: ServiceError | None = None
    ) -> None:
        """Add the encoder's last frames, mark the last one and queue ``Failure``/``Done``."""
        if self.ended:
            return
        self._add_frames(final_frames, last=True)
        self.done_reason = reason
        if error is not None:
            self._append(Failure(self._next_seq, error))
        self._append(Done(self._next_seq, reason, self._next_seq - 1, self._next_sample))
        self._evict()

    def _add_frames(self, frames: list[EncodedFrame], *, last: bool) -> None:
        if last and not frames:
            frames = [EncodedFrame(b"", 0)]
        for i, frame in enumerate(frames):
            seq, sample = self._next_seq, self._next_sample
            is_last = last and i == len(frames) - 1
            # A segment starts in this frame if its first sample falls inside it; the
            # last frame takes any marks left (segments too short to reach a frame).
            end = sample + frame.samples
            starts = False
            while self._marks and (self._marks[0][0] < end or is_last):
                mark_offset, text = self._marks.popleft()
                index, self._segments = self._segments, self._segments + 1
                starts = True
                at = min(mark_offset, max(sample, end - 1)) if frame.samples else sample
                self._append(SegmentMark(seq, at, text, index))
            self._append(Frame(seq, frame.payload, sample, frame.samples, is_last, starts))
            self._next_seq += 1
            self._next_sample = end

    def _append(self, item: OutItem) -> None:
        if item.position <= self._skip_through and not isinstance(item, Done):
            if isinstance(item, Frame):
                self._sent_samples += item.samples  # the client has it: never unsent
            return
        self._items.append(item)
        if isinstance(item, Frame):
            self._held_bytes += len(item.payload)
            self._held_samples += item.samples
        self.changed.set()

    def _evict(self) -> None:
        """Drop the oldest items beyond the replay bounds (never unsent ones while attached)."""
        limit = self.sent_index if self.attached else self.end_index
        while (
            self._items
            and self._base < limit
            and (self._held_bytes > self._replay_max_bytes or self._held_samples > self._replay_max_samples)
        ):
            self._pop_front()

    def _pop_front(self) -> None:
        item = self._items.popleft()
        self._base += 1
        samples = 0
        if isinstance(item, Frame):
            samples = item.samples
            self._held_bytes -= len(item.payload)
            self._held_samples -= samples
        self._evicted_position = max(self._evicted_position, item.position)
        if self.sent_index < self._base:  # detached: what was evicted can never be sent
            self._sent_samples += samples
            self.sent_index = self._base

    # --- the response cache ------------------------------------------------------

    def snapshot(self) -> list[OutItem] | None:
        """Every item of a finished stream, or None when some were already evicted."""
        if not self.ended or self._evicted_position >= 0:
            return None
        return list(self._items)

    def load(self, items: Sequence[OutItem]) -> None:
        """Fill a new outbox with a finished stream's items (a response-cache hit)."""
        for item in items:
            self._append(item)
            if isinstance(item, Done):
                self.done_reason = item.reason
                self._next_seq = item.last_seq + 1
                self._next_sample = item.samples

    # --- consuming -----------------------------------------------------------

    @property
    def unsent_samples(self) -> int:
        """Output samples numbered but not yet handed to the attached socket."""
        return self._next_sample - self._sent_samples

    def ready(self, index: int) -> list[OutItem]:
        """Every item from absolute ``index`` on that exists now (empty: wait for ``changed``).

        Raises:
            LookupError: an item from ``index`` was already evicted.
        """
        offset = index - self._base
        if offset < 0:
            raise LookupError(f"item {index} was evicted")
        items = self._items
        if offset == 0:
            return list(items)
        return [items[i] for i in range(offset, len(items))]

    async def wait_change(self) -> None:
        """Until an item is added (or :meth:`poke` is called)."""
        self.changed.clear()
        await self.changed.wait()

    def poke(self) -> None:
        """Wake whoever waits in :meth:`wait_change` (a sender whose lease was revoked)."""
        self.changed.set()

    def mark_sent(self, index: int) -> None:
        """Everything before absolute ``index`` is on the socket."""
        for i in range(self.sent_index, index):
            item = self._items[i - self._base]
            if isinstance(item, Frame):
                self._sent_samples += item.samples
        self.sent_index = index
        self._evict()

    def check_resumable(self, after_seq: int) -> None:
        """Raise ResumeExpired when an item after ``after_seq`` was already evicted."""
        if after_seq < self._evicted_position:
            raise ResumeExpired(
                f"frames after seq {after_seq} are no longer held "
                f"(the buffer starts after seq {self._evicted_position})"
            )

    def rewind_to(self, after_seq: int) -> int:
        """Point the sender at the first item a client that has ``after_seq`` still needs.

        Returns:
            The absolute index to send from.

        Raises:
            ResumeExpired: an item it needs was evicted.
        """
        self.check_resumable(after_seq)
        index = self._base
        while index < self.end_index and self._items[index - self._base].position <= after_seq:
            index += 1
        # Frames are contiguous: what was sent before ``index`` ends where the next frame starts.
        self._sent_samples = next(
            (item.sample for item in list(self._items)[index - self._base :] if isinstance(item, Frame)),
            self._next_sample,
        )
        self.sent_index = index
        return index
