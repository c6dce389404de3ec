"""No network in tests: block every connect and DNS lookup, or let only loopback through."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest


class NetworkUsed(AssertionError):
    pass


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise NetworkUsed(f"network use attempted: {args!r}")


@contextmanager
def network_refused() -> Iterator[None]:
    """Fail any connect or DNS lookup (and set HF_HUB_OFFLINE) inside the block."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setattr(socket.socket, "connect", _refuse)
    mp.setattr(socket.socket, "connect_ex", _refuse)
    mp.setattr(socket, "getaddrinfo", _refuse)
    mp.setattr(socket, "create_connection", _refuse)
    try:
        yield
    finally:
        mp.undo()


_real_connect = socket.socket.connect
_real_getaddrinfo = socket.getaddrinfo


def _loopback_connect(sock: socket.socket, address: Any) -> Any:
    host = address[0] if isinstance(address, tuple) else None
    if host is None or not ipaddress.ip_address(host).is_loopback:
        raise NetworkUsed(f"network use attempted: {address!r}")
    return _real_connect(sock, address)


def _loopback_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
    if host not in ("127.0.0.1", "::1", "localhost", None):
        raise NetworkUsed(f"DNS lookup attempted: {host!r}")
    return _real_getaddrinfo(host, *args, **kwargs)


@contextmanager
def loopback_only(*, hub_offline: bool = True) -> Iterator[None]:
    """Like :func:`network_refused`, but loopback connections (our own server) pass.

    ``hub_offline=False`` leaves ``HF_HUB_OFFLINE`` alone: for a stand-in hub on 127.0.0.1.
    """
    mp = pytest.MonkeyPatch()
    if hub_offline:
        mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setattr(socket.socket, "connect", _loopback_connect)
    mp.setattr(socket, "getaddrinfo", _loopback_getaddrinfo)
    try:
        yield
    finally:
        mp.undo()
