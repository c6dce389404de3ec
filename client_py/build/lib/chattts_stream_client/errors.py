"""Typed exceptions: one class per wire error code (docs/protocol.md), plus the client's own."""

from __future__ import annotations

from typing import Any


class ChatTTSStreamError(Exception):
    """Base of every error this client raises.

    Attributes:
        code: the wire error code (``overloaded``, ...) or the client's own
            (``connection_lost``, ``timeout``, ``protocol``).
        message: the server's human-readable message.
        stream_id: the stream it concerns, when it concerns one.
        retry_after_ms: when retrying may help, how long to wait first.
    """

    code = "internal"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        stream_id: str | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.stream_id = stream_id
        self.retry_after_ms = retry_after_ms

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class BadRequest(ChatTTSStreamError):
    """A message or field the server refused (``bad_request``)."""

    code = "bad_request"


class TextTooLong(ChatTTSStreamError):
    """Text over the server's ``max_text_chars`` or pending-text limit (``text_too_long``)."""

    code = "text_too_long"


class Unsupported(ChatTTSStreamError):
    """Unknown format, sample rate or voice (``unsupported``)."""

    code = "unsupported"


class DuplicateId(ChatTTSStreamError):
    """The stream id is already live on the connection (``duplicate_id``)."""

    code = "duplicate_id"


class TooManyStreams(ChatTTSStreamError):
    """Over the server's ``max_streams`` on one connection (``too_many_streams``)."""

    code = "too_many_streams"


class RetryableError(ChatTTSStreamError):
    """An error that a later retry may not get; ``retry_after_ms`` says when."""


class RateLimited(RetryableError):
    """Over this client's rate (``rate_limited``)."""

    code = "rate_limited"


class Overloaded(RetryableError):
    """The server's queue is full (``overloaded``)."""

    code = "overloaded"


class UnknownStream(ChatTTSStreamError):
    """A resume token the server does not hold: the stream expired or went elsewhere (``unknown_stream``)."""

    code = "unknown_stream"


class ResumeExpired(ChatTTSStreamError):
    """The frames needed after a reconnect were already evicted (``resume_expired``)."""

    code = "resume_expired"


class EngineError(ChatTTSStreamError):
    """The model failed on this stream (``engine_error``); the audio before it was delivered."""

    code = "engine_error"


class ShuttingDown(RetryableError):
    """The server is draining; connect to another replica (``shutting_down``)."""

    code = "shutting_down"


class InternalError(ChatTTSStreamError):
    """Anything unexpected on the server (``internal``)."""

    code = "internal"


class Unauthorized(ChatTTSStreamError):
    """The server wants a valid API key or refuses this Origin (close 1008, HTTP 401/403; client-side)."""

    code = "unauthorized"


class ConnectionLost(ChatTTSStreamError):
    """The connection went away and could not be resumed in time (client-side)."""

    code = "connection_lost"


class StreamTimeout(ChatTTSStreamError, TimeoutError):
    """Nothing arrived within the client's ``read_timeout`` (client-side)."""

    code = "timeout"


class ProtocolViolation(ChatTTSStreamError):
    """The server broke the wire contract (client-side)."""

    code = "protocol"


ERRORS: dict[str, type[ChatTTSStreamError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        TextTooLong,
        Unsupported,
        DuplicateId,
        TooManyStreams,
        RateLimited,
        Overloaded,
        UnknownStream,
        ResumeExpired,
        EngineError,
        ShuttingDown,
        InternalError,
    )
}


def error_from(message: dict[str, Any]) -> ChatTTSStreamError:
    """The exception for a wire ``error`` message (unknown codes become :class:`ChatTTSStreamError`)."""
    code = str(message.get("code", "internal"))
    cls = ERRORS.get(code, ChatTTSStreamError)
    retry = message.get("retry_after_ms")
    return cls(
        str(message.get("message", code)),
        code=code,
        stream_id=message.get("id") if isinstance(message.get("id"), str) else None,
        retry_after_ms=int(retry) if isinstance(retry, int | float) else None,
    )
