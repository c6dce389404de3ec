"""Domain errors: why the service refused a request or a stream failed, in no wire format.

The service, the engine client and the text input raise these. Each front end
maps them to its own wire codes (``protocol.code_of`` for the WebSocket and
the OpenAI-compatible endpoint); nothing below the front ends knows a code.
"""

from __future__ import annotations


class ServiceError(Exception):
    """A request the service refuses, or a stream that failed.

    Attributes:
        message: human readable and safe to show a client (no internals).
        retry_after_ms: set when retrying later may succeed.
    """

    def __init__(self, message: str, *, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_ms = retry_after_ms


class InvalidRequest(ServiceError):
    """A missing or invalid field, or text with nothing to speak."""


class TextTooLong(ServiceError):
    """More text than the server takes for one stream (or waiting for a sentence end)."""


class Unsupported(ServiceError):
    """A format, sample rate or voice this server does not have."""


class UnknownVoice(Unsupported):
    """A voice name this server (or the client's tenant) does not have.

    Attributes:
        name: the name asked for (shortened when long).
        choices: the valid names, as a phrase (``default, alloy, …, seed:<int>``), so each
            front end can word its own refusal around them.
    """

    def __init__(self, name: str, choices: str = "") -> None:
        super().__init__(f"unknown voice {name!r}" + (f"; use one of {choices}" if choices else ""))
        self.name = name
        self.choices = choices


class RateLimited(ServiceError):
    """The client starts streams faster than its rate allows; ``retry_after_ms`` says when."""


class Overloaded(ServiceError):
    """The engine's queue is full, or its breaker is open; ``retry_after_ms`` says when to retry."""


class Draining(ServiceError):
    """The server is shutting down; reconnect elsewhere."""


class EngineFailed(ServiceError):
    """The model failed while generating this stream."""


class EngineUnavailable(ServiceError):
    """The inference loop is not running."""


class UnknownStream(ServiceError):
    """No stream with this resume token is held here."""


class ResumeExpired(ServiceError):
    """Frames the client still needs were evicted from the replay buffer."""


class NotFound(ServiceError):
    """No voice (or other named thing) with this id is held here."""


class LimitReached(ServiceError):
    """A bounded store is full (the voices folder); delete something first."""


class StartupError(Exception):
    """The server cannot start; the message is one line naming the cause and the flag to change."""
