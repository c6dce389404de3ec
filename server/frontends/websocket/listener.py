"""The WebSocket server on one bound socket, with the settings every WebSocket listener shares.

A server process listens on its WebSocket port; a front-end process of ``--frontend-processes
N`` also on its own loopback port, where its siblings forward the resumes of its streams
(``server.streams.routing``). Both serve the same handler, probes and limits, so a forwarded
resume is treated exactly as one from a client.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve

from server.config import Settings
from server.frontends.ports import PortGuard
from server.frontends.websocket.guarded import guarded_connections
from server.frontends.websocket.routes import Routes
from server.sockets import bind_socket
from server.streams.routing import RouterConfig


async def serve_websocket(
    handler: Callable[[ServerConnection], Awaitable[None]],
    sock: socket.socket,
    routes: Routes,
    settings: Settings,
    guard: PortGuard,
) -> Server:
    """Serve ``handler`` on ``sock`` (bound, not yet listening), its TCP connections held to ``guard``."""
    s = settings
    return await serve(
        handler,
        sock=sock,
        process_request=routes,
        compression=None,  # audio does not compress; deflate only costs CPU
        max_size=s.max_message_bytes,
        max_queue=16,
        ping_interval=20,
        ping_timeout=20,
        open_timeout=s.header_timeout_s,
        close_timeout=s.close_timeout_s,
        create_connection=guarded_connections(guard),
        server_header=s.server_name,
    )


def sibling_socket(routing: RouterConfig | None, opened: list[socket.socket]) -> socket.socket | None:
    """A front-end process's loopback port, bound (appended to ``opened``); None in any other process.

    The supervisor holds the port bound with ``SO_REUSEPORT`` (never listening) from start to
    end, so a child started again in the same slot gets the same port: tokens its predecessor
    signed still name this slot (it regenerates their streams).

    Raises:
        StartupError: the port cannot be bound.
    """
    if routing is None or not routing.siblings:
        return None
    port = urlsplit(routing.advertise_url).port or 0
    return bind_socket("127.0.0.1", port, "--sibling-ports", opened, reuse_port=True)
