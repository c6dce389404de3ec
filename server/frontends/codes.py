"""Domain errors → the wire codes every front end answers with (``docs/protocol.md``'s error table).

The WebSocket's ``error`` message, the OpenAI-shaped HTTP errors and Wyoming's
``error`` event all name the same codes, so one table serves them all.
"""

from __future__ import annotations

from typing import Final

from server import errors

#: Each domain error's wire code (``docs/protocol.md``'s error table).
CODES: Final[dict[type[errors.ServiceError], str]] = {
    errors.InvalidRequest: "bad_request",
    errors.TextTooLong: "text_too_long",
    errors.Unsupported: "unsupported",
    errors.RateLimited: "rate_limited",
    errors.Overloaded: "overloaded",
    errors.Draining: "shutting_down",
    errors.EngineFailed: "engine_error",
    errors.EngineUnavailable: "internal",
    errors.UnknownStream: "unknown_stream",
    errors.ResumeExpired: "resume_expired",
    errors.NotFound: "not_found",
    errors.LimitReached: "limit_reached",
}


def code_of(error: errors.ServiceError) -> str:
    """The wire code of a domain error (``internal`` for one without its own)."""
    for kind in type(error).__mro__:
        code = CODES.get(kind)
        if code is not None:
            return code
    return "internal"
