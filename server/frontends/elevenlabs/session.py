"""One ElevenLabs WebSocket, sans I/O: ``stream-input`` / ``multi-stream-input`` messages in, ours out.

ElevenLabs' streaming protocol is text in, audio out, per *context* (``multi-stream-input``;
``stream-input`` has one, unnamed): ``{"text", "context_id", "flush", "close_context",
"voice_settings", "xi_api_key"}`` and ``{"close_socket": true}`` from the client;
``{"audio", "alignment", "normalizedAlignment", "isFinal", "contextId"}`` back. Each context
is one incremental stream of the service: text is ``append``ed, ``flush`` is ``flush``, and
the context's end is the stream's ``end`` (or its cancel). What the real clients do and need
(pipecat's ``ElevenLabsTTSService``, ``livekit-plugins-elevenlabs``):

- a context opens with ``{"text": " ", "voice_settings": …}``; ``{"text": ""}`` is a keep-alive on
  ``multi-stream-input`` (and the end of the text on ``stream-input``);
- ``auto_mode=true`` (pipecat's default) sends whole sentences without a trailing space: each
  text message is spoken at once (a ``flush``), so sentences are never run together;
- ``close_context`` right after a bare ``flush`` (one that carries no words) lets the flushed
  text finish (the end of a turn: pipecat's, and LiveKit's end of input); otherwise, after a
  message with words (LiveKit's auto mode flushes every sentence it sends), it is an
  interruption and the context's generation is cancelled at once;
  either way ``isFinal`` follows, and no audio of a cancelled context is sent;
- every audio message carries ``contextId`` (pipecat drops audio without it), and a segment's
  words ride on the message with its last audio: ``alignment`` with times from the segment's
  first sample (pipecat adds each alignment's span to its clock), ``normalizedAlignment`` with
  times from the context's start (LiveKit reads them as they are).

:mod:`server.frontends.elevenlabs.socket` carries the actions out on an aiohttp WebSocket.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from server.errors import InvalidRequest, ServiceError
from server.frontends.access import tenant_of
from server.frontends.codes import code_of
from server.frontends.elevenlabs.alignment import ws_alignment
from server.frontends.elevenlabs.formats import OutputFormat, VoiceSettings, speed_of, voice_settings
from server.frontends.messages import INVALID_CLOSE_CODE, INVALID_CLOSE_REASON, BadMessage, InvalidBudget
from server.streams.items import Done, Failure, Frame, OutItem, Words
from server.streams.lifecycle import Lease
from server.streams.request import SpeechRequest
from server.streams.service import SpeechService
from server.streams.stream import Stream

#: The unnamed context of ``stream-input`` (its messages carry no ``contextId``).
SINGLE = ""
#: A context id is the client's string; bound it like our stream ids.
MAX_CONTEXT_ID = 128


@dataclass(frozen=True)
class Send:
    """Send a JSON text message."""

    message: dict[str, Any]


@dataclass(frozen=True)
class Deliver:
    """Send ``stream``'s items as they come (through :meth:`ElevenLabsSession.render`)."""

    context_id: str
    stream: Stream
    lease: Lease


@dataclass(frozen=True)
class Close:
    """Close the WebSocket (after what was sent before it)."""

    code: int
    reason: str


Action = Send | Deliver | Close


@dataclass(eq=False)
class Context:
    """One context: its stream, and what its last messages said."""

    stream: Stream
    lease: Lease
    flushed_last: bool = False  # the client's last words were followed by a bare flush
    cancelled: bool = False
    words: list[Words] = field(default_factory=list)  # waiting for the next audio message


@dataclass(frozen=True, kw_only=True)
class SocketOptions:
    """What the URL of one ElevenLabs WebSocket asked for (its other query parameters are ignored)."""

    multi: bool
    voice: str
    output: OutputFormat
    auto_mode: bool
    seed: int | None
    max_contexts: int


class ElevenLabsSession:
    """The state of one ElevenLabs WebSocket: its contexts by id.

    Args:
        service: opens and frees streams.
        options: the URL's voice, format and flags.
        client: the client's rate-limit identity; ``None`` while the key is still to come in
            the first message (``xi_api_key``).
        admit_key: checks a key from the first message; returns the client's identity.
        abort: drops the connection at once (its reader fell too far behind).
        count_error: counts an error sent, by code.
        invalid: the connection's ``--invalid-messages-per-s``: past it, close 1008 (as ``/v1/stream``).
    """

    def __init__(
        self,
        service: SpeechService,
        options: SocketOptions,
        *,
        client: str | None,
        admit_key: Callable[[str | None], str],
        abort: Callable[[str], None],
        count_error: Callable[[str], None],
        invalid: InvalidBudget,
    ) -> None:
        self._service = service
        self._options = options
        self._client = client
        self._admit_key = admit_key
        self._abort = abort
        self._count_error = count_error
        self._invalid = invalid
        self.contexts: dict[str, Context] = {}
        self._closing = False  # close_socket, or stream-input's one context has ended

    # --- client messages -----------------------------------------------------------------

    def receive(self, message: object) -> list[Action]:
        """One parsed JSON message from the client; returns what to do, in order."""
        if not isinstance(message, dict):
            return self._error("bad_request", "each message is a JSON object", None)
        if self._client is None:
            key = message.get("xi_api_key")
            try:
                self._client = self._admit_key(key if isinstance(key, str) else None)
            except PermissionError as denied:
                return [Close(1008, str(denied))]
        if message.get("close_socket") is True:
            return self._close_socket()
        context_id = self._context_id(message)
        if isinstance(context_id, list):
            return context_id
        try:
            return self._on_context(context_id, message)
        except ServiceError as exc:
            return self._error(code_of(exc), exc.message, context_id, final=context_id not in self.contexts)
        except BadMessage as bad:  # voice_settings of the wrong shape
            return self._error("bad_request", bad.message, context_id, final=context_id not in self.contexts)

    def bad_message(self, problem: str) -> list[Action]:
        """A frame that is no JSON object."""
        return self._error("bad_request", problem, None)

    def _context_id(self, message: dict[str, Any]) -> str | list[Action]:
        if not self._options.multi:
            return SINGLE
        value = message.get("context_id", message.get("contextId"))
        if value is None:
            return "default"
        if not isinstance(value, str) or not 0 < len(value) <= MAX_CONTEXT_ID:
            return self._error("bad_request", f"context_id must be a string of 1 to {MAX_CONTEXT_ID}", None)
        return value

    def _on_context(self, context_id: str, message: dict[str, Any]) -> list[Action]:
        text = message.get("text")
        if text is not None and not isinstance(text, str):
            raise InvalidRequest("text must be a string")
        settings = voice_settings(message.get("voice_settings"))  # checked on every message
        context = self.contexts.get(context_id)
        actions: list[Action] = []
        closing = message.get("close_context") is True
        if context is None:
            if closing or (not text and message.get("flush") is not True):
                return []  # a keep-alive, or closing a context that is gone: nothing to do
            context, opened = self._open(context_id, settings)
            actions += opened
        try:
            self._feed(context, message, text, closing)
        except ServiceError as exc:  # the context stays (its pump too, when it opened just now)
            return actions + self._error(code_of(exc), exc.message, context_id)
        return actions

    def _feed(self, context: Context, message: dict[str, Any], text: str | None, closing: bool) -> None:
        """A message's text, flush and close for its (open) context."""
        feed = context.stream.text
        assert feed is not None
        if text == "" and not self._options.multi:
            feed.end()  # stream-input: empty text is the end of the input
            return
        if text:
            feed.append(text)
        explicit = message.get("flush") is True
        if explicit or (text and text.strip() and self._options.auto_mode):
            feed.flush()
        # Only a bare flush (no words with it) ends the client's text: pipecat's end of a turn and
        # LiveKit's end of input send one. LiveKit's auto mode sends every sentence with a flush,
        # and an interruption closes its context right after one: that must cancel, not finish.
        if text and text.strip():
            context.flushed_last = False
        elif explicit:
            context.flushed_last = True
        if closing:
            self._close_context(context)

    def _open(self, context_id: str, settings: VoiceSettings | None) -> tuple[Context, list[Action]]:
        if len(self.contexts) >= self._options.max_contexts:
            raise InvalidRequest(f"at most {self._options.max_contexts} context(s) per connection")
        assert self._client is not None
        options = self._options
        request = SpeechRequest(
            name=context_id or "elevenlabs",
            text="",
            voice=options.voice,
            speed=speed_of(settings),
            format=options.output.format,
            sample_rate=options.output.sample_rate,
            seed=options.seed,
            incremental=True,
            word_timestamps=True,
        )
        lease = Lease(self._abort)
        client = self._client
        owner = tenant_of(client) if client is not None else None
        stream = self._service.open(request, lease, resumable=False, client=client, owner=owner)
        context = Context(stream, lease)
        self.contexts[context_id] = context
        return context, [Deliver(context_id, stream, lease)]

    def _close_context(self, context: Context) -> None:
        """The end of a turn (after an explicit flush) lets it finish; otherwise an interruption."""
        feed = context.stream.text
        if context.flushed_last and feed is not None and not feed.ended:
            feed.end()
        else:
            context.cancelled = True
            context.stream.cancel()

    def _close_socket(self) -> list[Action]:
        self._closing = True
        for context in self.contexts.values():
            context.cancelled = True
            context.stream.cancel()
        return [] if self.contexts else [Close(1000, "close_socket")]

    def _error(self, code: str, message: str, context_id: str | None, *, final: bool = False) -> list[Action]:
        self._count_error(code)
        body: dict[str, Any] = {"error": code, "message": message}
        if context_id is not None and self._options.multi:
            body["contextId"] = context_id
        actions: list[Action] = [Send(body)]
        if final and context_id is not None:  # a context refused at its start ends here
            actions.append(Send(self._final(context_id)))
        if self._invalid.spend(code):  # the message's fault, past --invalid-messages-per-s
            self._count_error("too_many_invalid")
            actions.append(Close(INVALID_CLOSE_CODE, INVALID_CLOSE_REASON))
        return actions

    # --- sending ----------------------------------------------------------------------------

    def render(self, context_id: str, items: list[OutItem]) -> list[dict[str, Any]]:
        """A run of a context's items as messages: its audio (with the words before it), then the end."""
        context = self.contexts.get(context_id)
        if context is None:
            return []
        messages: list[dict[str, Any]] = []
        audio = bytearray()
        for item in items:
            if isinstance(item, Frame):
                audio += item.payload
            elif isinstance(item, Words):
                context.words.append(item)
            elif isinstance(item, Failure) and not context.cancelled:
                code = code_of(item.error)
                self._count_error(code)
                messages.append(self._tagged(context_id, {"error": code, "message": item.error.message}))
            elif isinstance(item, Done):
                if audio and not context.cancelled:
                    messages.append(self._audio(context_id, context, bytes(audio)))
                    audio = bytearray()
                messages.append(self._final(context_id))
        if audio and not context.cancelled:
            messages.insert(0, self._audio(context_id, context, bytes(audio)))
        return messages

    def _audio(self, context_id: str, context: Context, audio: bytes) -> dict[str, Any]:
        rate = self._options.output.sample_rate
        words, context.words = context.words, []
        message: dict[str, Any] = {"audio": base64.b64encode(audio).decode("ascii"), "isFinal": None}
        # ``alignment``: from the first sample of the message's first segment, so that its span
        # (what pipecat adds to its clock) is exactly the segments it times.
        first = words[0].start if words else 0
        message["alignment"] = _joined([ws_alignment(w, rate, first) for w in words])
        message["normalizedAlignment"] = _joined([ws_alignment(w, rate, 0) for w in words])
        return self._tagged(context_id, message)

    def _final(self, context_id: str) -> dict[str, Any]:
        return self._tagged(context_id, {"isFinal": True})

    def _tagged(self, context_id: str, message: dict[str, Any]) -> dict[str, Any]:
        if self._options.multi:
            message["contextId"] = context_id
        return message

    def delivered(self, context_id: str) -> list[Action]:
        """A context's last message went out: free its stream; close when nothing is left to do."""
        context = self.contexts.pop(context_id, None)
        if context is not None:
            self._service.abandon(context.stream)
        if not self.contexts and (self._closing or not self._options.multi):
            return [Close(1000, "done")]
        return self.close_if_idle()

    def close_if_idle(self) -> list[Action]:
        """During a drain, a connection without a context is closed (1012: reconnect elsewhere)."""
        return [Close(1012, "server is restarting")] if self._service.draining and not self.contexts else []

    def end_inputs(self) -> None:
        """The client was silent past its inactivity timeout: every context's text ends."""
        for context in self.contexts.values():
            feed = context.stream.text
            if feed is not None and not feed.ended:
                feed.end()

    def connection_lost(self) -> None:
        """The client is gone: every context stops generating and is freed (nothing can resume it)."""
        contexts, self.contexts = self.contexts, {}
        for context in contexts.values():
            self._service.abandon(context.stream)


def _joined(alignments: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Several segments' alignments in one message: their lists one after the other (None: none)."""
    if not alignments:
        return None
    if len(alignments) == 1:
        return alignments[0]
    return {key: [v for a in alignments for v in a[key]] for key in alignments[0]}
