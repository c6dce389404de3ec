"""The HTTP API's access log, with API keys cut out of every logged request target.

Browsers cannot set headers on a WebSocket, so a key may come as ``?api_key=``, and a client
may send it the same way to the HTTP API. aiohttp's own access log writes the request line
whole, key included; this one writes the same facts with the value of every ``api_key``
query parameter (by its decoded name, as the access gate reads it) replaced.
"""

from __future__ import annotations

import logging
from typing import Final
from urllib.parse import unquote_plus

from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse

REDACTED: Final = "[redacted]"
#: The query parameter that carries an API key (``server.frontends.access.presented_key``).
KEY_PARAM: Final = "api_key"


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
