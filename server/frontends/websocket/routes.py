"""Plain HTTP on the WebSocket port: ``/health``, ``/ready``, ``/metrics``, the demo page.

Answered from the ``websockets`` server's ``process_request`` before any
handshake; ``/v1/stream`` goes on to the handshake unless the server drains
or is full.
"""

from __future__ import annotations

import asyncio
import http
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

STREAM_PATH = "/v1/stream"
DEMO_DIR = Path(__file__).resolve().parents[3] / "client_js"
_CONTENT_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
}


@dataclass(frozen=True)
class Probes:
    """What the routes ask the server (read at each request)."""

    healthy: Callable[[], bool]
    ready: Callable[[], bool]
    draining: Callable[[], bool]
    full: Callable[[], bool]
    metrics: Callable[[], bytes]
    #: The handshake comes from another replica forwarding a resume (served while draining).
    forwarded: Callable[[Request], bool] = lambda request: False


class Routes:
    """``process_request`` for the WebSocket server."""

    def __init__(self, probes: Probes) -> None:
        self._probes = probes

    async def __call__(self, connection: ServerConnection, request: Request) -> Response | None:
        """The answer to a plain HTTP request, or None to go on with the WebSocket handshake."""
        probes = self._probes
        path = urlsplit(request.path).path
        if path == STREAM_PATH:
            if probes.draining() and not probes.forwarded(request):
                return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, "draining\n")
            if probes.full():
                return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, "too many connections\n")
            return None
        if path == "/health":
            ok = probes.healthy()
            return connection.respond(
                http.HTTPStatus.OK if ok else http.HTTPStatus.SERVICE_UNAVAILABLE,
                "ok\n" if ok else "inference loop stalled\n",
            )
        if path == "/ready":
            ok = probes.ready()
            return connection.respond(
                http.HTTPStatus.OK if ok else http.HTTPStatus.SERVICE_UNAVAILABLE,
                "ready\n" if ok else "not ready\n",
            )
        if path == "/metrics":
            return _response(200, probes.metrics(), "text/plain; version=0.0.4; charset=utf-8")
        if path in ("/", "/index.html"):
            # File reads go to a thread: the event loop never waits for a disk.
            return await asyncio.to_thread(
                _static, DEMO_DIR / "demo" / "index.html", "text/html; charset=utf-8"
            )
        if path.startswith("/client_js/"):
            return await asyncio.to_thread(_static_under, DEMO_DIR, path.removeprefix("/client_js/"))
        return connection.respond(http.HTTPStatus.NOT_FOUND, "not found\n")


def _response(status: int, body: bytes, content_type: str) -> Response:
    headers = Headers()
    headers["Content-Type"] = content_type
    headers["Content-Length"] = str(len(body))
    headers["Cache-Control"] = "no-store"
    return Response(status, http.HTTPStatus(status).phrase, headers, body)


def _static(path: Path, content_type: str) -> Response:
    if not path.is_file():
        return _response(404, b"not found\n", "text/plain")
    return _response(200, path.read_bytes(), content_type)


def _static_under(root: Path, relative: str) -> Response:
    """Serve a file below ``root`` only (no ``..`` escapes)."""
    target = (root / relative).resolve()
    if not target.is_relative_to(root) or target.suffix not in _CONTENT_TYPES:
        return _response(404, b"not found\n", "text/plain")
    return _static(target, _CONTENT_TYPES[target.suffix])
