"""The WebSocket port's TCP connections held to the port's guard (its share of the open files).

The ``websockets`` server builds one :class:`ServerConnection` (an asyncio protocol) per TCP
connection, and lets its ``create_connection`` argument name a subclass. The subclass made
here counts every TCP connection of the port, the ones still in their opening handshake and
the plain HTTP probes (``/health``) too, before ``websockets`` sees a byte: one over the
port's cap reads an HTTP 503 and is closed, and never reaches the handshake. (Established
WebSocket connections are also held to ``--max-connections`` by the handshake gate,
:class:`~server.frontends.websocket.routes.Routes`.)

An admitted connection is not read while more than a bound waits unsent for it
(:data:`~server.frontends.flow.MAX_UNSENT_BYTES`): ``websockets`` answers every ping from
``data_received`` whatever its write buffer holds, so without this a peer that floods pings
and never reads the pongs grows the server's memory by all it sends. The
library's own read pausing (``max_queue``, through the transport it is given) composes with
it in :class:`~server.frontends.flow.FlowTransport`, and the writes made in one turn of the
event loop leave together (:mod:`server.frontends.websocket.coalesce`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final, cast

from websockets.asyncio.server import ServerConnection

from server.frontends.flow import FlowTransport
from server.frontends.ports import PortGuard, refuse
from server.frontends.websocket.coalesce import CoalescingTransport

_BODY: Final = b"too many connections\n"
#: What a connection over the cap reads.
REFUSAL: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)


def guarded_connections(guard: PortGuard) -> type[ServerConnection]:
    """A :class:`ServerConnection` subclass that admits each TCP connection through ``guard``."""

    class GuardedConnection(ServerConnection):
        """A WebSocket server connection that is refused, untouched by ``websockets``, over the cap."""

        _refused: Callable[[], None] | None = None
        _flow: FlowTransport | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            if guard.admit(None) is not None:
                self._refused = refuse(transport, REFUSAL, guard)
                return
            # Its writes of one loop turn leave in one system call (coalesce.py).
            self._flow = CoalescingTransport(cast(asyncio.Transport, transport))
            super().connection_made(self._flow)

        def data_received(self, data: bytes) -> None:
            if self._flow is not None:
                super().data_received(data)
                self._flow.after_read()  # pongs pile up unsent: stop reading until they drain

        def eof_received(self) -> None:
            if self._refused is None:
                super().eof_received()

        def pause_writing(self) -> None:
            if self._flow is not None:
                super().pause_writing()

        def resume_writing(self) -> None:
            if self._flow is not None:
                self._flow.writes_resumed()
                super().resume_writing()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused is not None:
                self._refused()
                return
            guard.release(None)
            super().connection_lost(exc)

    return GuardedConnection
