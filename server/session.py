"""Per-stream state: numbering frames, segment marks, and the bounded outbox.

A :class:`StreamSession` turns the scheduler's events (segment starts, native
audio, the end) into the ordered items a client must receive: ``segment``
messages, binary frames (seq, sample offset, flags, payload) and ``done``.
The items stay in an outbox so that a sender can fall behind, and so that a
resumed connection can be served from any seq still held. Slot numbers are
not stored: they belong to the connection a stream is attached to and are
added when sending. No sockets and no model here.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from server.audio.base import EncodedFrame, FrameEncoder
from server.engine.base import NATIVE_SAMPLE_RATE, AudioArray
from server.protocol import FLAG_LAST, FLAG_SEGMENT_START, DoneReason, ProtocolError


@dataclass(frozen=True, slots=True)
class OutItem:
    """One thing to send, in order.

    Attributes:
        position: frames: their seq; a ``segment`` message: the seq of the frame
            it precedes; ``done``: last seq + 1. A resume after seq ``n`` replays
            every item with ``position > n``.
        message: a control message without ``slot`` (added when sent), or None.
        payload: the frame's payload when this is a frame.
        flags: frame flags.
        sample: the frame's first sample offset at the output rate.
    """

    position: int
    message: dict[str, Any] | None = None
    payload: bytes = b""
    flags: int = 0
    sample: int = 0
    samples: int = 0

    @property
    def is_frame(self) -> bool:
        """Whether this item is a binary frame."""
        return self.message is None


class BufferOverflow(ProtocolError):
    """A stream piled up more unsent audio than allowed (its reader is too slow)."""

    def __init__(self) -> None:
        super().__init__("internal", "too much unsent audio: the connection is not reading")


def new_stream_token() -> str:
    """An unguessable stream token: 192 random bits, URL-safe."""
    return secrets.token_urlsafe(24)


class StreamSession:
    """Numbering and buffering of one stream's output (event-loop side, no I/O)."""

    def __init__(
        self,
        *,
        client_id: str,
        encoder: FrameEncoder,
        max_unsent_s: float,
        token: str | None = None,
    ) -> None:
        self.client_id = client_id
        self.token = token or new_stream_token()
        self.encoder = encoder
        self.sample_rate = encoder.sample_rate
        self.created = time.monotonic()
        self.first_frame_at: float | None = None
        self._items: deque[OutItem] = deque()
        self._base = 0  # absolute index of self._items[0]
        self._next_seq = 0
        self._next_sample = 0  # output samples numbered so far
        self._native_in = 0  # native samples received so far
        self._marks: deque[tuple[int, str]] = deque()  # (output sample offset, text)
        self._max_unsent_samples = int(max_unsent_s * self.sample_rate)
        self.done_reason: DoneReason | None = None
        self.changed = asyncio.Event()
        self.sent_index = 0  # absolute index of the next item to send
        self._sent_samples = 0

    # --- producing -----------------------------------------------------------

    @property
    def ended(self) -> bool:
        """``done`` has been queued: nothing more will be added."""
        return self.done_reason is not None

    @property
    def end_index(self) -> int:
        """Absolute index one past the last item."""
        return self._base + len(self._items)

    def on_segment(self, text: str) -> None:
        """A new text segment starts with the next native sample."""
        offset = self._native_in * self.sample_rate // NATIVE_SAMPLE_RATE
        self._marks.append((offset, text))

    def on_audio(self, audio: AudioArray) -> None:
        """Encode and number native-rate audio.

        Raises:
            BufferOverflow: more than ``max_unsent_s`` of audio waits to be sent.
        """
        self._native_in += len(audio)
        self._add_frames(self.encoder.push(audio), last=False)
        if self.unsent_samples > self._max_unsent_samples:
            raise BufferOverflow()

    def finish(self, reason: DoneReason, error: ProtocolError | None = None) -> None:
        """Flush the encoder, mark the last frame and queue ``error``/``done``."""
        if self.ended:
            return
        self._add_frames(self.encoder.finish(), last=True)
        self.done_reason = reason
        if error is not None:
            message = {"type": "error", "id": self.client_id, "code": error.code, "message": error.message}
            self._append(OutItem(self._next_seq, message=message))
        done = {
            "type": "done",
            "id": self.client_id,
            "reason": reason,
            "last_seq": self._next_seq - 1,
            "samples": self._next_sample,
        }
        self._append(OutItem(self._next_seq, message=done))

    def _add_frames(self, frames: list[EncodedFrame], *, last: bool) -> None:
        if last and not frames:
            frames = [EncodedFrame(b"", 0)]
        for i, frame in enumerate(frames):
            seq, sample = self._next_seq, self._next_sample
            flags = FLAG_LAST if last and i == len(frames) - 1 else 0
            # A segment starts in this frame if its first sample falls inside it; the
            # last frame takes any marks left (segments too short to reach a frame).
            end = sample + frame.samples
            while self._marks and (self._marks[0][0] < end or flags & FLAG_LAST):
                mark_offset, text = self._marks.popleft()
                flags |= FLAG_SEGMENT_START
                message = {
                    "type": "segment",
                    "id": self.client_id,
                    "seq": seq,
                    "sample": min(mark_offset, max(sample, end - 1)) if frame.samples else sample,
                    "text": text,
                }
                self._append(OutItem(seq, message=message))
            self._append(
                OutItem(seq, payload=frame.payload, flags=flags, sample=sample, samples=frame.samples)
            )
            self._next_seq += 1
            self._next_sample = end

    def _append(self, item: OutItem) -> None:
        self._items.append(item)
        self.changed.set()

    # --- consuming -----------------------------------------------------------

    @property
    def unsent_samples(self) -> int:
        """Output samples numbered but not yet handed to the socket."""
        return self._next_sample - self._sent_samples

    def item(self, index: int) -> OutItem | None:
        """The item at absolute ``index``, or None when it is not produced yet.

        Raises:
            LookupError: the item was already evicted.
        """
        offset = index - self._base
        if offset < 0:
            raise LookupError(f"item {index} was evicted")
        return self._items[offset] if offset < len(self._items) else None

    def mark_sent(self, index: int) -> None:
        """Everything before absolute ``index`` is on the socket; drop what nobody needs."""
        for i in range(self.sent_index, index):
            self._sent_samples += self._items[i - self._base].samples
        self.sent_index = index
        while self._base < index and self._items:
            self._items.popleft()
            self._base += 1
