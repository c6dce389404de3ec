"""Opening one connection: the WebSocket upgrade and the server's ``hello``, each failure a typed error."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from chattts_stream_client.errors import ConnectionLost, ProtocolViolation, StreamTimeout, Unauthorized


async def handshake(
    url: str, headers: dict[str, str], limit_s: float
) -> tuple[ClientConnection, dict[str, Any]]:
    """Connect to ``url`` and read its ``hello``; returns the open connection and the ``hello``.

    Args:
        url: the stream endpoint (``ws://host:port/v1/stream``).
        headers: handshake headers (``Authorization`` among them when the client has a key).
        limit_s: seconds for the upgrade, and again for the ``hello``.

    Raises:
        Unauthorized: the server refused the key (HTTP 401/403, or a 1008 close before ``hello``).
        ConnectionLost: the server cannot be reached, refused the upgrade, or greeted badly.
        StreamTimeout: no ``hello`` within ``limit_s``.
        ProtocolViolation: the first message is not a ``hello``.
    """
    try:
        ws = await connect(
            url,
            additional_headers=headers,
            compression=None,
            max_size=2**24,
            open_timeout=limit_s,
            ping_interval=20,
            ping_timeout=20,
        )
    except InvalidStatus as exc:
        status = exc.response.status_code
        message = f"the server refused the connection: HTTP {status}"
        if status in (401, 403):
            raise Unauthorized(message) from None
        raise ConnectionLost(message, code=f"http_{status}") from None
    except (OSError, TimeoutError, InvalidURI, InvalidHandshake, ConnectionClosed, EOFError) as exc:
        raise ConnectionLost(f"cannot connect to {url}: {exc!r}") from exc
    try:
        async with asyncio.timeout(limit_s):
            hello = json.loads(await ws.recv())
    except TimeoutError:
        ws.transport.abort()
        raise StreamTimeout(f"no hello from {url} within {limit_s} s") from None
    except (ConnectionClosed, ValueError) as exc:
        ws.transport.abort()
        if isinstance(exc, ConnectionClosed) and exc.rcvd is not None and exc.rcvd.code == 1008:
            raise Unauthorized(f"the server closed the connection: {exc.rcvd.reason}") from None
        raise ConnectionLost(f"bad greeting from {url}: {exc}") from exc
    if not isinstance(hello, dict) or hello.get("type") != "hello":
        ws.transport.abort()
        raise ProtocolViolation(f"expected hello, got {hello!r}")
    return ws, hello
