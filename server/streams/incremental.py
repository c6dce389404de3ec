"""Incremental text input: ``append``/``flush``/``end`` for streams started with ``incremental``.

A :class:`TextFeed` belongs to one stream. It buffers text
(:class:`~server.text.segments.TextBuffer`), hands each complete segment to the
stream's :class:`~server.core.client.Generation` at once, and speaks an
incomplete clause when no text has arrived for ``max_buffer_delay_ms`` (the
stall timer restarts on every ``append``). All of it runs on the event loop;
the timer is owned and cancelled here.

A ``flush`` speaks at once only text that ends a sentence or holds a clause's worth of speech
(:meth:`~server.text.segments.TextBuffer.flush_ready`); a shorter fragment is *held*: it merges
with the text that follows until that is enough, and is spoken at the latest
``max_buffer_delay_ms`` after the flush (a deadline later appends do not push back). So a storm
of ``append "a"``, ``flush`` pairs (or ElevenLabs ``auto_mode`` messages) makes segments of a
sensible size instead of one engine sequence per message.

Every segment is held to the engine's prompt budget (:class:`~server.streams.checks.PromptBudget`)
when its text arrives: an ``append`` whose unbreakable run (a long number) is over it is refused,
and a segment over it is cut at clause ends or spaces, so none fails inside the engine mid-stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from server.core.generation import Generation
from server.errors import InvalidRequest, TextTooLong
from server.streams.checks import PromptBudget
from server.text import tags
from server.text.segments import TextBuffer, last_run_start


class TextFeed:
    """The text side of one incremental stream (its first text already went out with the stream)."""

    def __init__(
        self,
        generation: Generation,
        buffer: TextBuffer,
        *,
        total_chars: int,
        max_total_chars: int,
        max_pending_chars: int,
        delay_s: float,
        budget: PromptBudget | None = None,
    ) -> None:
        #: The stream's generation, which each complete segment goes to.
        self.generation = generation
        self.buffer = buffer
        self.budget = budget
        self.total_chars = total_chars
        self.max_total_chars = max_total_chars
        self.max_pending_chars = max_pending_chars
        self.delay_s = delay_s
        self.ended = False
        #: ``append``/``flush``/``end`` messages read for this stream, taken or refused: a
        #: resumed client re-sends the ones after this count (lost with its old connection).
        self.received = 0
        #: A ``flush`` holds its text until it is enough to speak or its deadline passes.
        self.flush_held = False
        self._timer: asyncio.TimerHandle | None = None
        self._arm()

    def append(self, text: str) -> None:
        """More text.

        Raises:
            InvalidRequest: the text already ended, or a control tag is unknown or cannot close.
            TextTooLong: over the stream's total, or too much waiting for a sentence end.
        """
        self.received += 1
        self._check_open()
        self._check_tags(self.buffer.pending + text, open_end=True)
        if self.total_chars + len(text) > self.max_total_chars:
            raise TextTooLong(f"the stream's text would exceed {self.max_total_chars} characters")
        if len(self.buffer.pending) + len(text) > self.max_pending_chars:
            raise TextTooLong(
                f"more than {self.max_pending_chars} characters wait for a sentence end; send `flush`"
            )
        if self.budget is not None:  # the run the text continues, and the text's own runs
            pending = self.buffer.pending
            self.budget.check_runs(pending[last_run_start(pending) :] + text)
        self.total_chars += len(text)
        self._submit(self.buffer.append(text))
        if not self.flush_held:
            self._arm()
        elif not self.buffer.pending.strip():
            self._release_held()  # the held text went out with a complete sentence
        elif not self._tag_open() and self.buffer.flush_ready():
            self._release_held()  # the held text and what followed it are now enough

    def flush(self) -> None:
        """Speak what is buffered: now if a sentence or a clause, else soon (refused while a tag is open)."""
        self.received += 1
        self._check_open()
        self._check_tags(self.buffer.pending, open_end=False)
        if self.buffer.flush_ready():
            self._release_held()
        elif not self.flush_held and self.buffer.pending.strip():
            # Held: the stall timer now runs to the flush's deadline, not restarted by appends.
            self.flush_held = True
            self._arm()

    def end(self) -> None:
        """No more text: speak the rest, then the stream finishes (refused while a tag is open)."""
        self.received += 1
        self._check_open()
        self._check_tags(self.buffer.pending, open_end=False)
        self._release_held()
        self.ended = True
        self.generation.end_input()

    def close(self) -> None:
        """The stream is over (cancelled, failed or freed): stop the timer."""
        self.ended = True
        self._disarm()

    def _check_open(self) -> None:
        if self.ended:
            raise InvalidRequest("the stream already ended its text")

    @staticmethod
    def _check_tags(text: str, *, open_end: bool) -> None:
        """Control tags must be known; a tag may stay open only while more text can come."""
        problem = tags.problem(text, open_end=open_end)
        if problem is not None:
            raise InvalidRequest(problem)

    def _tag_open(self) -> bool:
        """A control tag at the end of the buffer still waits for its closing bracket."""
        return tags.open_tail(self.buffer.pending) < len(self.buffer.pending)

    def _release_held(self) -> None:
        """Speak everything buffered now; no flush is held any more."""
        self.flush_held = False
        self._disarm()
        self._submit(self.buffer.take_all())

    def _submit(self, segments: list[str]) -> None:
        if self.budget is not None:  # runs were checked as they came: cutting at spaces suffices
            segments = self.budget.fit(segments, hard=True)
        for segment in segments:
            self.generation.append(segment)

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
        if self.ended:
            return
        if self.flush_held and not self._tag_open():
            self._release_held()  # the held flush's deadline
            return
        self._submit(self.buffer.take_clause())
        self._arm()


def open_feed(
    generate: Callable[[tuple[str, ...]], Generation],
    text: str,
    *,
    segment_max_chars: int,
    max_total_chars: int,
    max_pending_chars: int,
    delay_s: float,
    budget: PromptBudget | None = None,
) -> TextFeed:
    """An incremental stream's text side: ``text``'s complete segments go to ``generate`` now.

    Raises:
        InvalidRequest: a run of ``text`` that cannot be cut is over ``budget``.
    """
    buffer = TextBuffer(max_chars=segment_max_chars)
    first = buffer.append(text)
    if budget is not None:
        budget.check_runs(text)
        first = budget.fit(first)
    generation = generate(tuple(first))
    return TextFeed(
        generation,
        buffer,
        total_chars=len(text),
        max_total_chars=max_total_chars,
        max_pending_chars=max_pending_chars,
        delay_s=delay_s,
        budget=budget,
    )
