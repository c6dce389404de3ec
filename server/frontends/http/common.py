"""What the HTTP routes share: the client key the access gate sets, errors in OpenAI's shape.

Every route of the OpenAI-compatible API (``http_api`` for speech and discovery,
``http_voices`` for voices from recordings) answers errors as
``{"error": {"message", "type", "param", "code"}}`` with our wire codes
(``protocol.code_of``), mapped to an HTTP status here.
"""

from __future__ import annotations

import json
import math
from typing import Final

from aiohttp import web

from server.errors import ServiceError
from server.frontends.codes import code_of
from server.frontends.http.transfer import BodyRefused, refused_response
from server.metrics import Metrics

#: The client's rate-limit identity, set by the access gate.
CLIENT: Final = web.RequestKey("client", str)
#: Our wire codes → HTTP status (the ``code`` of the error body stays ours).
STATUS: Final = dict(bad_request=400, text_too_long=400, unsupported=400, rate_limited=429, overloaded=429)
STATUS.update(shutting_down=503, engine_error=500, internal=500, not_found=404, limit_reached=409)
STATUS.update(timeout=408, too_many_connections=503)


def error_response(
    status: int, code: str, message: str, *, param: str | None = None, retry_after_ms: int | None = None
) -> web.Response:
    """A JSON error in OpenAI's shape; ``Retry-After`` (seconds) when retrying may help."""
    kind = (
        "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
    )
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    headers = {"Cache-Control": "no-store"}
    if retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_ms / 1000)))
    return web.json_response(body, status=status, headers=headers)


def counted_error(
    metrics: Metrics,
    status: int,
    code: str,
    message: str,
    *,
    param: str | None = None,
    retry_after_ms: int | None = None,
) -> web.Response:
    """:func:`error_response`, counted by code in ``chattts_errors``."""
    metrics.errors.labels(code=code).inc()
    return error_response(status, code, message, param=param, retry_after_ms=retry_after_ms)


def service_error(exc: ServiceError, metrics: Metrics, *, param: str | None = None) -> web.Response:
    """A domain error as its HTTP answer (counted by code)."""
    code = code_of(exc)
    return counted_error(
        metrics, STATUS.get(code, 500), code, exc.message, param=param, retry_after_ms=exc.retry_after_ms
    )


def refusal(code: str, message: str) -> bytes:
    """A whole ``503`` response (OpenAI's error shape, ``Connection: close``), for a socket over its cap."""
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}})
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        f"Cache-Control: no-store\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return (head + body).encode()


def body_refused(metrics: Metrics, refused: BodyRefused) -> web.Response:
    """A body that was not read (408 ``timeout``, 413), in OpenAI's shape; the connection closes after it."""
    return refused_response(counted_error(metrics, refused.status, refused.code, refused.message))
