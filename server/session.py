"""Per-stream state: numbering frames, segment marks, the replay buffer, resume tokens.

A :class:`StreamSession` turns a stream's encoded frames, segment starts and
end into the ordered items a client must receive: ``segment`` messages,
binary frames (seq, sample offset, flags, payload) and ``done``. The items
stay in a bounded replay buffer, so that a sender can fall behind and a
client that reconnects can ``resume`` from any seq still held. Slot numbers
are not stored: they belong to the connection a stream is attached to and
are added when sending. No sockets, no model, no encoder here.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from server.audio.base import EncodedFrame
from server.engine.base import NATIVE_SAMPLE_RATE
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


class ResumeExpired(ProtocolError):
    """Frames the client still needs were evicted from the replay buffer."""

    def __init__(self, after_seq: int, kept_from: int) -> None:
        super().__init__(
            "resume_expired",
            f"frames after seq {after_seq} are no longer held (the buffer starts after seq {kept_from})",
        )


_ROUTE = re.compile(r"[0-9A-Za-z_-]{1,64}")


def new_stream_token(route: str | None = None) -> str:
    """An unguessable stream token: 192 random bits, URL-safe.

    With a ``route`` (the handshake's ``X-Request-ID`` that the ingress hashed
    to pick this replica), the token is ``<route>.<secret>``, so that the ingress
    can hash a reconnect's ``?resume=`` back to the same replica. Only the secret
    part is unguessable; the route is not secret.
    """
    secret = secrets.token_urlsafe(24)
    if route is not None and _ROUTE.fullmatch(route):
        return f"{route}.{secret}"
    return secret


def redact(token: str) -> str:
    """A token as it may appear in logs: the route and 6 characters of the secret."""
    route, dot, secret = token.rpartition(".")
    return f"{route}{dot}{secret[:6]}…"


class StreamSession:
    """Numbering and buffering of one stream's output (event-loop side, no I/O).

    Memory is bounded twice: while a connection is attached, more than
    ``max_unsent_s`` of audio not yet handed to its socket raises
    :class:`BufferOverflow` (the caller aborts that connection); and items
    beyond ``replay_max_s`` seconds of audio or ``replay_max_bytes`` bytes are
    evicted oldest first, never an item the attached sender has not sent yet.
    """

    def __init__(
        self,
        *,
        client_id: str,
        fmt: str,
        sample_rate: int,
        max_unsent_s: float,
        replay_max_s: float,
        replay_max_bytes: int,
        token: str | None = None,
    ) -> None:
        self.client_id = client_id
        self.token = token or new_stream_token()
        self.format = fmt
        self.sample_rate = sample_rate
        self.created = time.monotonic()
        self.first_frame_at: float | None = None
        self._items: deque[OutItem] = deque()
        self._base = 0  # absolute index of self._items[0]
        self._held_bytes = 0
        self._held_samples = 0
        self._evicted_position = -1  # highest position evicted so far
        self._next_seq = 0
        self._next_sample = 0  # output samples numbered so far
        self._native_in = 0  # native samples received so far
        self._marks: deque[tuple[int, str]] = deque()  # (output sample offset, text)
        self._max_unsent_samples = int(max_unsent_s * sample_rate)
        self._replay_max_samples = int(replay_max_s * sample_rate)
        self._replay_max_bytes = replay_max_bytes
        self.done_reason: DoneReason | None = None
        self.changed = asyncio.Event()
        #: The connection this stream is attached to (None: detached).
        self.owner: object | None = None
        self.detached_at: float | None = None
        self.sent_index = 0  # absolute index of the next item the attached sender sends
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
        if self.owner is not None and self.unsent_samples > self._max_unsent_samples:
            raise BufferOverflow()

    def finish(
        self, reason: DoneReason, final_frames: list[EncodedFrame], error: ProtocolError | None = None
    ) -> None:
        """Add the encoder's last frames, mark the last one and queue ``error``/``done``."""
        if self.ended:
            return
        self._add_frames(final_frames, last=True)
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
        self._evict()

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
        self._held_bytes += len(item.payload)
        self._held_samples += item.samples
        self.changed.set()

    def _evict(self) -> None:
        """Drop the oldest items beyond the replay bounds (never unsent ones while attached)."""
        limit = self.sent_index if self.owner is not None else self.end_index
        while (
            self._items
            and self._base < limit
            and (self._held_bytes > self._replay_max_bytes or self._held_samples > self._replay_max_samples)
        ):
            self._pop_front()

    def _pop_front(self) -> None:
        item = self._items.popleft()
        self._base += 1
        self._held_bytes -= len(item.payload)
        self._held_samples -= item.samples
        self._evicted_position = max(self._evicted_position, item.position)
        if self.sent_index < self._base:  # detached: what was evicted can never be sent
            self._sent_samples += item.samples
            self.sent_index = self._base

    # --- the response cache ------------------------------------------------------

    def snapshot(self) -> list[OutItem] | None:
        """Every item of a finished stream, or None when some were already evicted."""
        if not self.ended or self._evicted_position >= 0:
            return None
        return list(self._items)

    def load(self, items: Sequence[OutItem]) -> None:
        """Fill a new session with a cached stream's items (relabelled with this stream's id)."""
        for item in items:
            if item.message is not None:
                item = replace(item, message={**item.message, "id": self.client_id})
            self._append(item)
            if item.message is not None and item.message["type"] == "done":
                self.done_reason = item.message["reason"]
                self._next_seq = item.message["last_seq"] + 1
                self._next_sample = item.message["samples"]

    # --- consuming -----------------------------------------------------------

    @property
    def unsent_samples(self) -> int:
        """Output samples numbered but not yet handed to the attached socket."""
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

    async def wait_item(self, index: int) -> OutItem | None:
        """The item at absolute ``index``, waiting until it exists; None when the stream ended first."""
        while True:
            item = self.item(index)
            if item is not None or self.ended:
                return item
            self.changed.clear()
            await self.changed.wait()

    def mark_sent(self, index: int) -> None:
        """Everything before absolute ``index`` is on the socket."""
        for i in range(self.sent_index, index):
            self._sent_samples += self._items[i - self._base].samples
        self.sent_index = index
        self._evict()

    def check_resumable(self, after_seq: int) -> None:
        """Raise ResumeExpired when an item after ``after_seq`` was already evicted."""
        if after_seq < self._evicted_position:
            raise ResumeExpired(after_seq, self._evicted_position)

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
            (item.sample for item in list(self._items)[index - self._base :] if item.is_frame),
            self._next_sample,
        )
        self.sent_index = index
        return index
