"""The streams sharing one client's connection, by id and by slot: each server message goes to its stream."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from chattts_stream_client.errors import ChatTTSStreamError, ProtocolViolation, error_from
from chattts_stream_client.stream import SpeechStream
from chattts_stream_client.wire import parse_frame

# The client's logger, not this module's: users configure the one name the client has always logged under.
log = logging.getLogger("chattts_stream_client.client")


class Demux:
    """A client's live streams, and the routing of the server's messages and frames to them.

    A stream is known by its id from the moment it is made, by its slot once the server has
    ``started`` or ``resumed`` it on the current connection (frames carry only the slot), and by
    its resume token while a ``resume`` it sent is unanswered (an error answers with the token).
    """

    def __init__(self, spawn: Callable[[Coroutine[Any, Any, Any]], None]) -> None:
        """Route to no stream yet.

        Args:
            spawn: runs a coroutine as a task the client owns (a resumed stream's text goes out
                from one, not from the reader).
        """
        #: Every stream of the client that has not finished, by id.
        self.streams: dict[str, SpeechStream] = {}
        self._by_slot: dict[int, SpeechStream] = {}
        self._resuming: list[SpeechStream] = []  # resumes sent, not yet answered, in order
        self._spawn = spawn

    def new_connection(self) -> None:
        """A fresh connection: no slot is held on it and no resume is pending."""
        self._by_slot.clear()
        self._resuming = []

    def detach(self) -> list[SpeechStream]:
        """The connection is gone: its slots and pending resumes go; returns the streams that must come back.

        A stream the server had started (it has a token) waits to be resumed; one still waiting
        for its ``started`` will be started again.
        """
        self.new_connection()
        waiting = [s for s in self.streams.values() if not s.finished and s.phase != "pending"]
        for stream in waiting:
            stream.phase = "detached" if stream.token is not None else "starting"
        return waiting

    def resume_sent(self, stream: SpeechStream) -> None:
        """``stream``'s ``resume`` is about to go out: its answer (or an error with its token) goes to it."""
        self._resuming.append(stream)

    def forget(self, stream: SpeechStream) -> None:
        """Nothing more will come for ``stream``."""
        self.streams.pop(stream.id, None)
        if stream.slot is not None and self._by_slot.get(stream.slot) is stream:
            del self._by_slot[stream.slot]

    def fail(self, stream: SpeechStream, error: ChatTTSStreamError) -> None:
        """End ``stream`` with ``error`` and forget it."""
        stream._fail_with(error)
        self.forget(stream)

    async def on_frame(self, raw: bytes) -> None:
        """An audio frame: to the stream holding its slot.

        Raises:
            ProtocolViolation: no stream holds the frame's slot.
        """
        received = time.perf_counter()
        header, payload = parse_frame(raw)
        stream = self._by_slot.get(header.slot)
        if stream is None:
            raise ProtocolViolation(f"frame for slot {header.slot}, which no stream holds")
        await stream._on_frame(header, payload, received)

    def on_message(self, message: dict[str, Any]) -> None:
        """A JSON message: to the stream its ``id`` names (an error may name a resume token instead)."""
        kind = message.get("type")
        stream = self.streams.get(message["id"]) if isinstance(message.get("id"), str) else None
        if kind == "started" and stream is not None:
            stream._on_started(message)
            self._by_slot[stream.slot] = stream  # type: ignore[index]
        elif kind == "resumed" and stream is not None:
            if stream in self._resuming:
                self._resuming.remove(stream)
            stream._on_resumed(message)
            self._by_slot[stream.slot] = stream  # type: ignore[index]
            self._spawn(stream._send_text())
        elif kind == "segment" and stream is not None:
            stream._on_segment(message)
        elif kind == "words" and stream is not None:
            stream._on_words(message)
        elif kind == "resume_degraded" and stream is not None:
            stream.degraded = str(message.get("reason", "the audio may differ"))
            log.warning("stream %s resumed, but its audio may differ: %s", stream.id, stream.degraded)
        elif kind == "done" and stream is not None:
            stream._on_done(message)
            self.forget(stream)
        elif kind == "error":
            self._on_error(message, stream)

    def _on_error(self, message: dict[str, Any], stream: SpeechStream | None) -> None:
        error = error_from(message)
        token = message.get("stream")
        resumed = next((s for s in self._resuming if s.token == token), None) if token is not None else None
        if resumed is not None:
            # unknown_stream / resume_expired answer a resume: that stream cannot come back.
            self._resuming.remove(resumed)
            self.fail(resumed, error)
            return
        if stream is None:
            log.warning("server error: %s", error)
            return
        stream._on_error(error)
        if stream.finished:
            self.forget(stream)
