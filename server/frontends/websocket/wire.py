"""Wire protocol v1: message types, parsing with error codes, every server message, the audio header.

Pure values in, pure values out: nothing here touches sockets or asyncio,
so every rule of ``docs/protocol.md`` is testable with plain strings. This is
also where domain errors (``server.errors``) get their wire codes
(:func:`server.frontends.codes.code_of`), shared with the other front ends.
Validation of client messages is done by ``msgspec`` (typed structs with a
``type`` tag), which gives precise messages such as
``Expected `str`, got `int` - at `$.id```. The binary half, the 12-byte header in front of
every audio frame, is :mod:`server.frontends.websocket.header` (re-exported here).
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec

from server import errors
from server.frontends import messages
from server.frontends.codes import code_of
from server.frontends.common import (
    FrameMs,
    RefinePrompt,
    Seed,
    ServerInfo,
    Speed,
    Temperature,
    TopK,
    TopP,
)
from server.frontends.messages import BadMessage
from server.frontends.websocket.header import (  # re-exported: the wire's binary half
    FLAG_LAST as FLAG_LAST,
)
from server.frontends.websocket.header import (
    FLAG_SEGMENT_START as FLAG_SEGMENT_START,
)
from server.frontends.websocket.header import HEADER as HEADER
from server.frontends.websocket.header import HEADER_SIZE as HEADER_SIZE
from server.frontends.websocket.header import PROTOCOL_VERSION as PROTOCOL_VERSION
from server.frontends.websocket.header import FrameHeader as FrameHeader
from server.frontends.websocket.header import frame as frame
from server.frontends.websocket.header import unpack_frame as unpack_frame
from server.streams.items import Done, SegmentMark, Words
from server.streams.pace import Advice
from server.streams.request import SpeechRequest

# Stream ids are client strings; bound them so they cannot bloat replies.
MAX_ID_CHARS: Final = 128
# Without an explicit bound a request could ask for absurd sampling values.
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]


class ProtocolError(Exception):
    """A client error with a stable wire ``code``; answered with an ``error`` message.

    Attributes:
        code: one of the codes of the protocol's error table.
        message: human readable, safe to send (no internals).
        name: the client's id of the stream the error concerns, if one.
        retry_after_ms: set when retrying later may succeed.
        token: the resume token the client sent (resume errors name it).
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        name: str | None = None,
        retry_after_ms: int | None = None,
        token: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.name = name
        self.retry_after_ms = retry_after_ms
        self.token = token


def wire_error(
    error: errors.ServiceError, *, name: str | None = None, token: str | None = None
) -> ProtocolError:
    """A domain error as the ``error`` message it is answered with."""
    return ProtocolError(
        code_of(error), error.message, name=name, retry_after_ms=error.retry_after_ms, token=token
    )


class _Message(msgspec.Struct, tag_field="type", forbid_unknown_fields=False, frozen=True):
    """Base of client messages; unknown extra fields are ignored (forward compatibility)."""


class Start(_Message, tag="start", frozen=True):
    """Begin a stream."""

    id: Id
    text: str | None = None
    voice: str = "default"
    speed: Speed = 1.0
    format: str = "pcm16"
    sample_rate: int = 24_000
    seed: Seed | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    incremental: bool = False
    max_buffer_delay_ms: Annotated[int, msgspec.Meta(ge=0, le=60_000)] | None = None
    refine: bool = False
    refine_prompt: RefinePrompt = ""
    word_timestamps: bool = False
    frame_ms: FrameMs = 20


class Cancel(_Message, tag="cancel", frozen=True):
    """Stop a stream now."""

    id: Id


class Append(_Message, tag="append", frozen=True):
    """Add text to an incremental stream."""

    id: Id
    text: str


class Flush(_Message, tag="flush", frozen=True):
    """Speak an incremental stream's buffered text now."""

    id: Id


class End(_Message, tag="end", frozen=True):
    """No more text for an incremental stream."""

    id: Id


class Resume(_Message, tag="resume", frozen=True):
    """Re-attach a stream after a reconnect.

    ``request`` (the stream's ``start``, with its seed), ``segment`` and ``segment_sample``
    (the last ``segment`` message taken) let a replica regenerate a stream that is gone.
    """

    stream: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    after_seq: Annotated[int, msgspec.Meta(ge=-1, le=2**32 - 1)] = -1
    request: Start | None = None
    segment: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)] | None = None
    segment_sample: Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)] | None = None


ClientMessage = Start | Cancel | Append | Flush | End | Resume
_decoder: Final = msgspec.json.Decoder(ClientMessage)
_probe: Final = msgspec.json.Decoder(dict[str, Any])


def parse_client_message(raw: str | bytes, *, max_depth: int = 32) -> ClientMessage:
    """Decode and validate one text frame from a client (its size is bounded by the socket).

    ``max_depth`` bounds its nesting before the decoder recurses into it (``--max-json-depth``).

    Raises:
        ProtocolError: ``bad_request`` with a message naming the problem.
    """
    if isinstance(raw, bytes):
        raise ProtocolError("bad_request", "binary frames are not accepted from clients; send JSON text")
    try:
        return messages.decode(raw, _decoder, max_depth=max_depth)
    except BadMessage as bad:
        if bad.validation is None:  # malformed, too deep, or a number out of range
            raise ProtocolError("bad_request", bad.message, name=_name_of(raw, bad)) from None
        raise ProtocolError("bad_request", _describe(bad.validation), name=_name_of(raw, bad)) from None


def _describe(text: str) -> str:
    if "`$.type`" in text or "Object missing required field `type`" in text:
        return f"unknown or missing message type ({text}); expected one of {sorted(_TYPES)}"
    if text.endswith(".frame_ms`"):  # msgspec says "Invalid enum value 30": name the choices
        return f"invalid message: {text}; frame_ms is one of 20, 40, 60"
    return f"invalid message: {text}"


_TYPES: Final = ("start", "cancel", "append", "flush", "end", "resume")


def _name_of(raw: str, bad: BadMessage) -> str | None:
    """Best-effort ``id`` of an invalid message, so the error can name the stream."""
    if bad.validation is None and bad.path is None:
        return None  # not JSON within the bounds: not decoded a second time
    try:
        value = _probe.decode(raw).get("id")
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return value if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS else None


def speech_request(msg: Start) -> SpeechRequest:
    """The service's request for a ``start`` message."""
    return SpeechRequest(
        name=msg.id,
        text=msg.text,
        voice=msg.voice,
        speed=msg.speed,
        format=msg.format,
        sample_rate=msg.sample_rate,
        seed=msg.seed,
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        incremental=msg.incremental,
        max_buffer_delay_ms=msg.max_buffer_delay_ms,
        refine=msg.refine,
        refine_prompt=msg.refine_prompt,
        word_timestamps=msg.word_timestamps,
        frame_ms=msg.frame_ms,
    )


# --- server to client -------------------------------------------------------

_encoder: Final = msgspec.json.Encoder()


def encode(message: dict[str, Any]) -> str:
    """Serialize a server message (compact JSON, UTF-8 text)."""
    return _encoder.encode(message).decode("utf-8")


def hello(info: ServerInfo, voices: tuple[str, ...], advice: Advice | None = None) -> str:
    """The first message on every connection (``weights`` and ``compute`` when the engine says them).

    ``voices``: the voice names now (voices made from recordings come and go); ``advice``:
    the pace a stream started now would have (absent until the server measured one).
    """
    message: dict[str, Any] = {
        "type": "hello",
        "protocol": PROTOCOL_VERSION,
        "server": info.server,
        "sample_rate": info.sample_rate,
        "sample_rates": list(info.sample_rates),
        "formats": list(info.formats),
        "voices": list(voices),
        "max_text_chars": info.max_text_chars,
        "max_streams": info.max_streams,
        "resume_ttl_s": info.resume_ttl_s,
    }
    if info.weights is not None:
        message["weights"] = info.weights
    if info.compute:
        message["compute"] = dict(info.compute)
    if advice is not None:
        message |= advice.fields()
    return encode(message)


def started(
    name: str, slot: int, token: str, fmt: str, sample_rate: int, preskip: int,
    seed: int | None = None, advice: Advice | None = None, frame_ms: int = 20,
) -> str:  # fmt: skip
    """The answer to ``start``; ``preskip`` only for raw Opus (decoded samples to drop first).

    ``frame_ms``: the stream's frame length (the ``start``'s, 20 unless it asked for another).

    ``seed``: the stream's seed (the client's, or the one the server picked); ``advice``:
    how much the listener should buffer (docs/protocol.md, "How much to buffer").
    """
    message: dict[str, Any] = {
        "type": "started",
        "id": name,
        "slot": slot,
        "stream": token,
        "format": fmt,
        "sample_rate": sample_rate,
        "frame_ms": frame_ms,
    }
    if preskip:
        message["preskip"] = preskip
    if seed is not None:
        message["seed"] = seed
    if advice is not None:
        message |= advice.fields()
    return encode(message)


def resume_degraded(name: str, token: str, reason: str) -> str:
    """Sent before the audio of a regenerated stream that may differ from the lost one's."""
    return encode({"type": "resume_degraded", "id": name, "stream": token, "reason": reason})


def resumed(
    name: str,
    slot: int,
    after_seq: int,
    token: str,
    fmt: str,
    sample_rate: int,
    preskip: int,
    text_received: int | None = None,
) -> str:
    """The answer to ``resume``; every item after ``after_seq`` follows.

    ``text_received`` (incremental streams only): how many ``append``/``flush``/``end``
    messages the server has read for the stream, so the client re-sends the rest.
    """
    message: dict[str, Any] = {
        "type": "resumed",
        "id": name,
        "slot": slot,
        "stream": token,
        "after_seq": after_seq,
        "format": fmt,
        "sample_rate": sample_rate,
    }
    if preskip:
        message["preskip"] = preskip
    if text_received is not None:
        message["text_received"] = text_received
    return encode(message)


def segment(name: str, slot: int, mark: SegmentMark) -> str:
    """A text segment starts in the frame with seq ``mark.position``."""
    return encode(
        {
            "type": "segment",
            "id": name,
            "slot": slot,
            "seq": mark.position,
            "sample": mark.sample,
            "text": mark.text,
            "index": mark.index,
        }
    )


def words(name: str, slot: int, item: Words) -> str:
    """A segment's words and their sample spans (streams started with ``word_timestamps``)."""
    spans = [{"text": w.text, "start": w.start, "end": w.end} for w in item.words]
    return encode(
        {
            "type": "words",
            "id": name,
            "slot": slot,
            "seq": item.position,
            "sample": item.start,
            "end": item.end,
            "words": spans,
        }
    )


def done(name: str, slot: int, item: Done) -> str:
    """The stream's last message."""
    return encode(
        {
            "type": "done",
            "id": name,
            "slot": slot,
            "reason": item.reason,
            "last_seq": item.last_seq,
            "samples": item.samples,
        }
    )


def error(err: ProtocolError) -> str:
    """An ``error`` message for ``err``."""
    message: dict[str, Any] = {"type": "error", "code": err.code, "message": err.message}
    if err.name is not None:
        message["id"] = err.name
    if err.retry_after_ms is not None:
        message["retry_after_ms"] = err.retry_after_ms
    if err.token is not None:  # resume errors name the token the client sent
        message["stream"] = err.token
    return encode(message)
