"""CORS on the HTTP API: preflights answered, and responses readable, for the allowed origins.

A page on another origin (the demo page on the WebSocket port is one: another port is another
origin) can only call ``/v1/audio/speech`` with a JSON body and an ``Authorization`` header,
or ``DELETE`` a voice, after the browser's ``OPTIONS`` preflight is answered with the
``Access-Control-Allow-*`` headers; and it can read any answer only when the answer carries
``Access-Control-Allow-Origin``. An origin is allowed as on the WebSocket
(``--allowed-origins``; empty: any). A preflight carries no API key (browsers never send one
there), so it is answered before the key check; a disallowed origin gets 403 without allow
headers, and the browser then sends nothing.
"""

from __future__ import annotations

from typing import Final

from aiohttp import web

from server.frontends.access import origin_allowed
from server.frontends.http.common import error_response

ALLOW_METHODS: Final = "GET, POST, DELETE"
ALLOW_HEADERS: Final = "Authorization, Content-Type, X-API-Key"
#: How long a browser may keep a preflight's answer (seconds).
MAX_AGE_S: Final = 600


class Cors:
    """The CORS answers for the origins in ``allowed`` (empty: any origin)."""

    def __init__(self, allowed: frozenset[str]) -> None:
        self.allowed = allowed

    def preflight(self, request: web.Request) -> web.Response | None:
        """The answer to a CORS preflight; None when ``request`` is not one."""
        origin = request.headers.get("Origin")
        if request.method != "OPTIONS" or origin is None:
            return None
        if "Access-Control-Request-Method" not in request.headers:
            return None
        if not origin_allowed(origin, self.allowed):
            return error_response(403, "forbidden", "this Origin may not use the API")
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Origin": origin,
                "Access-Control-Allow-Methods": ALLOW_METHODS,
                "Access-Control-Allow-Headers": ALLOW_HEADERS,
                "Access-Control-Max-Age": str(MAX_AGE_S),
                "Vary": "Origin",
            },
        )

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Before any response's headers go out (streamed audio too): let an allowed page read it."""
        origin = request.headers.get("Origin")
        if origin is None or not origin_allowed(origin, self.allowed):
            return
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = "Retry-After"
        response.headers.add("Vary", "Origin")
