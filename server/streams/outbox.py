"""One stream's output in order, numbered and bounded: what every front end reads and replays.

An :class:`Outbox` turns a stream's encoded frames, segment starts and end into the ordered
items a client must receive: :class:`SegmentMark`, :class:`Frame` (seq, sample offset,
payload), :class:`Failure` and :class:`Done` (and a segment's ``Words``): plain values in no
wire format (the front ends render them), in a bounded replay buffer, so that a sender can
fall behind and a client that reconnects can resume from any seq held. No sockets, no model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from server.audio.base import EncodedFrame
from server.core.events import EndReason
from server.engine_api import NATIVE_SAMPLE_RATE
from server.errors import InvalidRequest, ResumeExpired, ServiceError
from server.streams.budget import ITEM_OVERHEAD_BYTES
from server.streams.items import Done, Failure, Frame, OutItem, SegmentMark, Words, WordSpan


@dataclass(slots=True)
class _PendingMark:
    """A segment whose first frame is not numbered yet (and its words, once timed)."""

    offset: int  # its first sample, at the output rate
    text: str
    words: Words | None = None


class BufferOverflow(Exception):
    """More unsent audio piled up than allowed while attached (the reader is too slow)."""


class Outbox:
    """Numbering and buffering of one stream's output (event-loop side, no I/O).

    Memory is bounded twice: while ``attached``, more than ``max_unsent_s`` of
    audio not yet handed to the socket raises :class:`BufferOverflow`; and
    items beyond ``replay_max_s`` seconds of audio or ``replay_max_bytes``
    bytes are evicted oldest first, never one the attached sender has not
    sent yet. Every change is also told to ``charge`` (the server's memory budget,
    :mod:`server.streams.budget`); :meth:`release` gives it all back.
    """

    def __init__(
        self,
        *,
        sample_rate: int,
        max_unsent_s: float,
        replay_max_s: float,
        replay_max_bytes: int,
        charge: Callable[[int], None] | None = None,
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
        self._marks: deque[_PendingMark] = deque()  # segments whose first frame is not numbered yet
        self._segment_native = 0  # native sample where the newest segment starts
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
        #: Charges the stream's client (the memory budget); the stream charges what else it holds to it.
        self.charge = charge
        #: Bytes charged to the memory budget for the items held (payloads and their objects).
        self.charged_bytes = 0
        self._released = False
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

    def hold_until_ended(self) -> None:
        """Its sender sends nothing before the stream ends (a complete HTTP response).

        Every item then waits unsent until the end, however long the audio: ``max_unsent_s``
        (meant for a reader that falls behind a live stream) no longer applies; the memory
        budget, which counts every item held, bounds it.
        """
        self._max_unsent_samples = sys.maxsize

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
        self._segment_native = self._native_in
        self._marks.append(_PendingMark(self._output_offset(self._native_in), text))

    def on_words(self, words: Sequence[tuple[str, int, int]], native_length: int) -> None:
        """The newest segment's words, as (text, start, end) in native samples from its start.

        ``native_length``: the segment's whole length in native samples.

        Call it before that segment's last samples go to :meth:`on_frames`: the words then
        go out before the frame holding its last sample (right after its mark when the mark's
        frame is not numbered yet, so a segment's mark always comes first).
        """
        base = self._segment_native
        spans = tuple(
            WordSpan(text, self._output_offset(base + start), self._output_offset(base + end))
            for text, start, end in words
        )
        item = Words(
            self._next_seq, self._output_offset(base), self._output_offset(base + native_length), spans
        )
        if self._marks:  # the newest segment's mark (those before it went out first)
            self._marks[-1].words = item
        else:
            self._append(item)

    def _output_offset(self, native: int) -> int:
        return native * self.sample_rate // NATIVE_SAMPLE_RATE

    def on_frames(self, frames: list[EncodedFrame], native_samples: int) -> None:
        """Number frames encoded from ``native_samples`` more native-rate samples.

        Raises:
            BufferOverflow: attached, and more than ``max_unsent_s`` waits to be sent.
        """
        if self._released:
            return
        self._native_in += native_samples
        self._add_frames(frames, last=False)
        self._evict()
        if self.attached and self.unsent_samples > self._max_unsent_samples:
            raise BufferOverflow

    def finish(
        self, reason: EndReason, final_frames: list[EncodedFrame], error: ServiceError | None = None
    ) -> None:
        """Add the encoder's last frames, mark the last one and queue ``Failure``/``Done``."""
        if self.ended or self._released:
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
            while self._marks and (self._marks[0].offset < end or is_last):
                mark = self._marks.popleft()
                index, self._segments = self._segments, self._segments + 1
                starts = True
                at = min(mark.offset, max(sample, end - 1)) if frame.samples else sample
                self._append(SegmentMark(seq, at, mark.text, index))
                if mark.words is not None:
                    self._append(dataclasses.replace(mark.words, position=seq))
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
        self._count(_cost(item))
        self.changed.set()

    def _count(self, delta: int) -> None:
        self.charged_bytes += delta
        if self.charge is not None:
            self.charge(delta)

    def release(self) -> None:
        """The stream was freed: drop every item and give their bytes back to the budget."""
        self._released = True
        self._items.clear()
        self._held_bytes = self._held_samples = 0
        self._count(-self.charged_bytes)
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
        self._count(-_cost(item))
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

    @property
    def last_seq(self) -> int:
        """The seq of the newest frame numbered so far (-1 before the first)."""
        return self._next_seq - 1

    def check_resumable(self, after_seq: int) -> None:
        """Raise ResumeExpired when an item after ``after_seq`` was already evicted.

        Raises:
            InvalidRequest: ``after_seq`` is past the newest frame: the client cannot have it
                (a resume from there would wait for frames it claims to hold, or for nothing).
        """
        if after_seq > self.last_seq:
            newest = f"seq {self.last_seq}" if self.last_seq >= 0 else "none yet"
            raise InvalidRequest(f"after_seq {after_seq} is past the stream's newest frame ({newest})")
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


def _cost(item: OutItem) -> int:
    """What holding ``item`` costs the memory budget."""
    if isinstance(item, Frame):
        return ITEM_OVERHEAD_BYTES + len(item.payload)
    if isinstance(item, SegmentMark):
        return ITEM_OVERHEAD_BYTES + len(item.text)
    return ITEM_OVERHEAD_BYTES
