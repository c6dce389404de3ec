"""What the HTTP API logs: its access log and aiohttp's server log, API keys cut out of both.

Browsers cannot set headers on a WebSocket, so a key may come as ``?api_key=``, and a client
may send it the same way to the HTTP API. aiohttp's own access log writes the request line
whole, key included; :class:`RedactedAccessLogger` writes the same facts with the value of
every ``api_key`` query parameter (by its decoded name, as the access gate reads it)
replaced. aiohttp's server log (:data:`SERVER_LOG`, given to every request handler) logs each
malformed request as an ERROR with its traceback, and the exception quotes the bytes the
client sent (a request line too long: its start, a key too): :class:`ServerLogFilter` makes
a client's error one INFO line, and redacts every message.
"""

from __future__ import annotations

import logging
import re
import traceback
from typing import Final
from urllib.parse import unquote_plus

from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web import BaseRequest, StreamResponse

REDACTED: Final = "[redacted]"
#: The query parameter that carries an API key (``server.frontends.access.presented_key``).
KEY_PARAM: Final = "api_key"


#: An ``api_key=`` value anywhere in a text (a quoted request line), its name percent-encoded too.
_KEY_IN_TEXT: Final = re.compile(r"(?i)\bapi(?:_|%5f)key=[^&\s'\"\\]*")


def redact_text(text: str) -> str:
    """``text`` with every ``api_key=`` value in it replaced."""
    return _KEY_IN_TEXT.sub(f"{KEY_PARAM}={REDACTED}", text)


def redact(target: str) -> str:
    """``target`` (a path with its query) with the value of every ``api_key`` parameter replaced."""
    path, sep, query = target.partition("?")
    if not sep:
        return target
    parts = [
        f"{KEY_PARAM}={REDACTED}" if unquote_plus(part.partition("=")[0]) == KEY_PARAM else part
        for part in query.split("&")
    ]
    return path + "?" + "&".join(parts)


class RedactedAccessLogger(AbstractAccessLogger):
    """One line per request: peer, request line (keys redacted), status, bytes, time, user agent."""

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        """Write the request's line (called by aiohttp once the response is sent)."""
        major, minor = request.version
        self.logger.info(
            '%s "%s %s HTTP/%d.%d" %d %d %.3fs "%s"',
            request.remote,
            request.method,
            redact(request.raw_path),
            major,
            minor,
            response.status,
            response.body_length,
            time,
            request.headers.get("User-Agent", "-"),
        )

    @property
    def enabled(self) -> bool:
        """Whether the access logger writes anything (INFO enabled)."""
        return self.logger.isEnabledFor(logging.INFO)


class ServerLogFilter(logging.Filter):
    """aiohttp's server log, safe against what clients send (keys redacted, no traceback per bad request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite ``record`` in place; False drops it (a client's error below the INFO level)."""
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and exc.code < 500:  # the client's error, not ours
            first = (exc.message or "").strip().splitlines()[:1]
            record.msg = redact_text(f"{record.getMessage()}: {exc.code} {' '.join(first)}")
            record.args, record.exc_info, record.exc_text = (), None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
            return logging.getLogger(record.name).isEnabledFor(logging.INFO)
        record.msg, record.args = redact_text(record.getMessage()), ()
        if record.exc_info:
            record.exc_text = redact_text("".join(traceback.format_exception(*record.exc_info)).rstrip())
        return True


#: The logger every HTTP request handler of ours logs to (instead of ``aiohttp.server``).
SERVER_LOG: Final = logging.getLogger("server.frontends.http.aiohttp")
SERVER_LOG.addFilter(ServerLogFilter())
