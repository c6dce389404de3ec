"""Binding the server's ports before anything listens, so a busy port fails the start at once."""

from __future__ import annotations

import socket

from server.errors import StartupError


def bind_socket(
    host: str, port: int, flag: str, opened: list[socket.socket], *, reuse_port: bool = False
) -> socket.socket:
    """A non-blocking socket bound to ``host:port`` (not yet listening), appended to ``opened``.

    ``opened`` is the caller's list of sockets to close if the start fails later. With
    ``reuse_port`` (``--frontend-processes N``) several processes bind the same port and the
    kernel spreads the new connections over those listening.

    Raises:
        StartupError: the address cannot be resolved (named ``--host``) or the port cannot be
            bound (named ``flag``).
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise StartupError(f"cannot listen on {host}:{port} (--host): {exc.strerror or exc}") from None
    opened.append(sock)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as exc:
        raise StartupError(f"cannot listen on {host}:{port} ({flag}): {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock
