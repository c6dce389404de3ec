"""How every REST route of the HTTP port reads its body and starts a streamed answer.

One body reader for all (OpenAI's speech and voice uploads, ElevenLabs' text-to-speech): a
body is read within ``--max-message-bytes`` (aiohttp's ``client_max_size``, 413) and within
``--body-timeout-s`` of the handler's start (408), so a client trickling a byte a second
holds its connection for the deadline only. Each front end renders the refusal in its own
error shape; the connection closes after it, since the rest of the body was never read.

One start for every streamed answer: its length is unknown when the audio starts, so HTTP/1.1
gets a chunked body and HTTP/1.0 (nginx's default towards its upstreams), which has no
chunked encoding, a body that ends with the connection (``Connection: close``, no
``Content-Length``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import HttpVersion11, web


class BodyRefused(Exception):
    """The request's body was not read: too large (413) or too late (408).

    Attributes:
        status: the HTTP status.
        code: our wire code (``bad_request``, ``timeout``).
        message: what happened, naming the flag.
    """

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@asynccontextmanager
async def body_deadline(timeout_s: float) -> AsyncIterator[None]:
    """Read a body within ``timeout_s`` (``--body-timeout-s``).

    Raises:
        BodyRefused: 408 ``timeout`` when the deadline passes.
    """
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError:
        message = f"the request body did not arrive within {timeout_s:g} s (--body-timeout-s)"
        raise BodyRefused(408, "timeout", message) from None


async def read_body(request: web.Request, *, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body, at most ``max_bytes`` (the application's ``client_max_size``), within ``timeout_s``.

    Raises:
        BodyRefused: 413 over the size, 408 past the deadline.
    """
    async with body_deadline(timeout_s):
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise BodyRefused(413, "bad_request", f"request body over {max_bytes} bytes") from None


def refused_response(response: web.Response) -> web.Response:
    """``response`` (a :class:`BodyRefused` in a front end's shape), closing the connection after it."""
    response.force_close()  # the rest of the body is still on its way: no next request can follow
    return response


def streamed_response(request: web.Request, content_type: str) -> web.StreamResponse:
    """A response whose length is unknown when it starts, in a form ``request``'s HTTP version reads.

    HTTP/1.1: chunked. HTTP/1.0: the body ends when the connection closes after it. Either
    way a stream that fails after its first bytes is cut off by aborting the connection (a
    truncated chunked body, or a reset instead of a clean end).
    """
    response = web.StreamResponse(headers={"Content-Type": content_type, "Cache-Control": "no-store"})
    if request.version >= HttpVersion11:
        response.enable_chunked_encoding()
    else:
        response.force_close()
        response.headers["Connection"] = "close"
    return response
