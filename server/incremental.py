"""Incremental text input: ``append``/``flush``/``end`` for streams started with ``incremental``.

A :class:`TextFeed` belongs to one stream. It buffers text
(:class:`~server.text.TextBuffer`), hands each complete segment to the
scheduler at once, and speaks an incomplete clause when no text has arrived
for ``max_buffer_delay_ms`` (the stall timer restarts on every ``append``).
All of it runs on the event loop; the timer is owned and cancelled here.
"""

from __future__ import annotations

import asyncio

from server import tags
from server.protocol import Append, End, Flush, ProtocolError
from server.scheduler import ScheduledStream
from server.text import TextBuffer


class TextFeed:
    """The text side of one incremental stream."""

    def __init__(
        self,
        *,
        stream_id: str,
        max_segment_chars: int,
        max_total_chars: int,
        max_pending_chars: int,
        delay_s: float,
    ) -> None:
        self.stream_id = stream_id
        self.buffer = TextBuffer(max_chars=max_segment_chars)
        self.max_total_chars = max_total_chars
        self.max_pending_chars = max_pending_chars
        self.delay_s = delay_s
        self.handle: ScheduledStream | None = None
        self.total_chars = 0
        self.ended = False
        self._timer: asyncio.TimerHandle | None = None

    def first(self, text: str) -> list[str]:
        """Segments of the text that came with ``start`` (submitted with the stream)."""
        self._check_tags(text, open_end=True)
        self._count(text)
        segments = self.buffer.append(text)
        self._arm()
        return segments

    def apply(self, message: Append | Flush | End) -> None:
        """Carry out a client's ``append``, ``flush`` or ``end``."""
        if isinstance(message, Append):
            self.append(message.text)
        elif isinstance(message, Flush):
            self.flush()
        else:
            self.end()

    def append(self, text: str) -> None:
        """More text. Raises ProtocolError (``bad_request``, ``text_too_long``)."""
        self._check_open()
        self._check_tags(self.buffer.pending + text, open_end=True)
        self._count(text)
        if len(self.buffer.pending) + len(text) > self.max_pending_chars:
            raise ProtocolError(
                "text_too_long",
                f"more than {self.max_pending_chars} characters wait for a sentence end; send `flush`",
                stream_id=self.stream_id,
            )
        self._submit(self.buffer.append(text))
        self._arm()

    def flush(self) -> None:
        """Speak what is buffered now."""
        self._check_open()
        self._check_tags(self.buffer.pending, open_end=False)
        self._submit(self.buffer.take_all())
        self._disarm()

    def end(self) -> None:
        """No more text: speak the rest, then the stream finishes."""
        self._check_open()
        self._check_tags(self.buffer.pending, open_end=False)
        self._submit(self.buffer.take_all())
        self._disarm()
        self.ended = True
        if self.handle is not None:
            self.handle.end_input()

    def close(self) -> None:
        """The stream is over (cancelled, failed or forgotten): stop the timer."""
        self.ended = True
        self._disarm()

    def _check_open(self) -> None:
        if self.ended:
            raise ProtocolError(
                "bad_request", f"stream {self.stream_id!r} already ended its text", stream_id=self.stream_id
            )

    def _check_tags(self, text: str, *, open_end: bool) -> None:
        """Control tags must be known; a tag may stay open only while more text can come."""
        problem = tags.problem(text, open_end=open_end)
        if problem is not None:
            raise ProtocolError("bad_request", problem, stream_id=self.stream_id)

    def _count(self, text: str) -> None:
        if self.total_chars + len(text) > self.max_total_chars:
            raise ProtocolError(
                "text_too_long",
                f"the stream's text would exceed {self.max_total_chars} characters",
                stream_id=self.stream_id,
            )
        self.total_chars += len(text)

    def _submit(self, segments: list[str]) -> None:
        if self.handle is not None:
            for segment in segments:
                self.handle.append_segment(segment)

    def _arm(self) -> None:
        """(Re)start the stall timer while text is pending."""
        self._disarm()
        if self.buffer.pending.strip() and not self.ended:
            self._timer = asyncio.get_running_loop().call_later(self.delay_s, self._stalled)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _stalled(self) -> None:
        self._timer = None
        if not self.ended:
            self._submit(self.buffer.take_clause())
            self._arm()
