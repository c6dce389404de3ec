"""Every listening port's TCP connections: capped per port, per client, and within a share of the fds.

One process serves up to three ports (WebSocket, HTTP, Wyoming), and all of them draw on one
open-files limit (``RLIMIT_NOFILE``). A port that let every connection in could use up the
fds, and then every other port fails to accept (the WebSocket's ``/health`` too). So each port
gets a :class:`PortGuard`: at most its cap of connections at once, the cap being
``--max-connections`` within the port's share of the fds (:func:`port_caps`), and optionally
at most ``--max-connections-per-client`` per client. A connection over a cap is answered at
once with the port's own refusal (an HTTP 503, a Wyoming ``error`` event), then closed, so
the client sees why instead of a hung connect.

:class:`GuardedProtocol` puts a guard in front of any asyncio protocol (the HTTP and Wyoming
servers); the WebSocket server, which builds its own protocol objects, uses
:func:`refuse` from its connection class. Both hand the protocol inside a
:class:`~server.frontends.flow.FlowTransport`, so an admitted connection is not read while
its answers pile up unsent (read backpressure). A refused connection lingers briefly, reading
and dropping what the client sends, so that its request arriving after the refusal does not
make the kernel reset the connection before the client read the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import time
from collections.abc import Callable
from typing import Final, Protocol, cast

from server.config import Settings
from server.frontends.access import client_identity
from server.frontends.flow import FlowTransport

log = logging.getLogger(__name__)

#: How long a refused connection is given to read its refusal before it is cut.
LINGER_S: Final = 1.0
#: Refused connections lingering at once per port, at most; more are closed at once.
MAX_LINGERING: Final = 32
#: A port logs its refusals once per this many seconds at most.
LOG_EVERY_S: Final = 10.0


def raise_fd_limit() -> int:
    """Raise the soft open-files limit to the hard one (as servers do); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return int(soft) if soft != resource.RLIM_INFINITY else 1 << 20


def port_caps(limit: int, reserve: int, ports: int, max_connections: int) -> tuple[int, int]:
    """(connections, lingering refusals) one of ``ports`` ports may hold at once.

    The fds left after ``reserve`` are split evenly; a port's lingering refusals come out of
    its share, so a port never holds more fds than its share, whatever its clients do.
    """
    share = max(2, (limit - reserve) // max(1, ports))
    lingering = min(MAX_LINGERING, share // 4)
    return max(1, min(max_connections, share - lingering)), lingering


class ClientCounts(Protocol):
    """The per-client connection counts all ports share (``server.streams.limits.ClientLimiter``)."""

    def open_connection(self, client: str) -> bool:
        """Count a connection of ``client``; False (not counted) at its cap."""
        ...

    def close_connection(self, client: str) -> None:
        """A counted connection of ``client`` ended."""
        ...


def limits_problem(settings: Settings) -> str | None:
    """Why the port limits cannot work as configured (one line naming the flag), or None."""
    s = settings
    if not 1 <= s.max_json_depth <= 500:  # decoders recurse per level; Python's limit is 1000
        return f"--max-json-depth {s.max_json_depth}: must be within 1 and 500"
    for flag, value in (
        ("--header-timeout-s", s.header_timeout_s),
        ("--body-timeout-s", s.body_timeout_s),
        ("--close-timeout-s", s.close_timeout_s),
        ("--wyoming-idle-timeout-s", s.wyoming_idle_timeout_s),
        ("--wyoming-text-timeout-s", s.wyoming_text_timeout_s),
    ):
        if not value > 0:
            return f"{flag} {value}: must be more than 0"
    if s.fd_reserve < 0:
        return f"--fd-reserve {s.fd_reserve}: must be 0 or more"
    return None


def port_guards(
    settings: Settings, ports: int, counts: ClientCounts, on_refused: Callable[[str], None]
) -> dict[str, PortGuard]:
    """Each port's guard (by name), for ``ports`` open ports, within the open-files limit.

    The soft limit is raised to the hard one first. HTTP and Wyoming hold at most
    ``--max-connections`` TCP connections within their share, counted per client in
    ``counts`` as well (by IP); the WebSocket port's TCP connections are held to its share
    only (its established connections to ``--max-connections`` by the handshake gate), so
    ``/health`` still answers while the port is full of WebSocket clients.
    """
    s = settings
    limit = raise_fd_limit()
    caps = port_caps(limit, s.fd_reserve, ports, s.max_connections)
    log.info("open files: %d; each of %d ports holds at most %d connections", limit, ports, caps[0])
    ws_caps = port_caps(limit, s.fd_reserve, ports, limit)
    return {
        "WebSocket": PortGuard("WebSocket", ws_caps, on_refused=on_refused),
        "HTTP": PortGuard("HTTP", caps, counts=counts, on_refused=on_refused),
        "Wyoming": PortGuard("Wyoming", caps, counts=counts, on_refused=on_refused),
    }


class PortGuard:
    """One port's open connections: a total cap and a per-client cap.

    Args:
        name: the port, for logs (``"HTTP"``).
        caps: connections open at once, and refused ones lingering at once (:func:`port_caps`).
        counts: the per-client counts all ports share; None: no per-client cap here.
        on_refused: called with the refusal's code for every connection refused (metrics).
    """

    def __init__(
        self,
        name: str,
        caps: tuple[int, int],
        *,
        counts: ClientCounts | None = None,
        on_refused: Callable[[str], None] = lambda code: None,
    ) -> None:
        self.name = name
        self.cap, self.max_lingering = caps
        self.open = 0
        self.lingering = 0
        self._counts = counts
        self._on_refused = on_refused
        self._logged_at = -LOG_EVERY_S
        self._unlogged = 0

    def admit(self, client: str | None) -> str | None:
        """Count a new connection from ``client`` (None: not counted per client).

        Returns None when admitted, else why not (``"the port is full"`` …), not counted.
        """
        if self.open >= self.cap:
            return self._refuse(f"the {self.name} port is at its {self.cap} connections")
        if client is not None and self._counts is not None and not self._counts.open_connection(client):
            return self._refuse("too many connections from this client")
        self.open += 1
        return None

    def _refuse(self, why: str) -> str:
        """Count a refusal; log one line per :data:`LOG_EVERY_S` at most (a flood must not flood the log)."""
        self._on_refused("too_many_connections")
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning("%s port refused %d connections (the last: %s)", self.name, self._unlogged, why)
            self._logged_at, self._unlogged = now, 0
        return why

    def release(self, client: str | None) -> None:
        """An admitted connection from ``client`` ended."""
        self.open -= 1
        if client is not None and self._counts is not None:
            self._counts.close_connection(client)


def refuse(transport: asyncio.BaseTransport, answer: bytes, guard: PortGuard) -> Callable[[], None]:
    """Write ``answer`` on a refused connection, half-close it, and cut it after :data:`LINGER_S`.

    Returns the function to call once the connection is lost (it frees the linger slot).
    With too many refusals lingering already, the connection is closed at once.
    """
    transport = cast(asyncio.Transport, transport)  # a TCP transport (uvloop's is no subclass)
    transport.write(answer)
    if guard.lingering >= guard.max_lingering or not transport.can_write_eof():
        transport.close()
        return lambda: None
    guard.lingering += 1
    transport.write_eof()
    timer = asyncio.get_running_loop().call_later(LINGER_S, transport.abort)

    def lost() -> None:
        timer.cancel()
        guard.lingering -= 1

    return lost


def peer_ip(transport: asyncio.BaseTransport) -> str:
    """The remote IP of ``transport`` (``"?"`` when unknown)."""
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "?"


class GuardedProtocol(asyncio.Protocol):
    """``inner``, behind ``guard``: a connection over a cap gets ``answer`` and is closed.

    Args:
        inner: the protocol that serves an admitted connection.
        guard: the port's caps.
        answer: the bytes a refused client reads (an HTTP 503, a Wyoming ``error``), for the
            reason it was refused.
        per_client: count the connection per client (its IP) as well.
    """

    def __init__(
        self, inner: asyncio.Protocol, guard: PortGuard, answer: Callable[[str], bytes], *, per_client: bool
    ) -> None:
        self._inner = inner
        self._guard = guard
        self._answer = answer
        self._per_client = per_client
        self._client: str | None = None
        self._refused: Callable[[], None] | None = None
        self._flow: FlowTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Admit the connection to ``inner``, or refuse it."""
        client = client_identity(None, peer_ip(transport)) if self._per_client else None
        if (why := self._guard.admit(client)) is not None:
            self._refused = refuse(transport, self._answer(why), self._guard)
            return
        self._client = client
        # The inner protocol's reading is held while writes are paused (read backpressure).
        self._flow = FlowTransport(cast(asyncio.Transport, transport))
        self._inner.connection_made(self._flow)

    def data_received(self, data: bytes) -> None:
        """Pass on (then hold reading if the answers pile up unsent), or drop what a refused client sends."""
        if self._flow is not None:
            self._inner.data_received(data)
            self._flow.after_read()

    def eof_received(self) -> bool | None:
        """Pass on; a refused connection closes."""
        return None if self._refused is not None else self._inner.eof_received()

    def pause_writing(self) -> None:
        """Pass on (the inner protocol's flow control)."""
        if self._flow is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        """Read again (unless the inner protocol holds reading) and pass on."""
        if self._flow is not None:
            self._flow.writes_resumed()
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        """Pass on and release the connection's place."""
        if self._refused is not None:
            self._refused()
            return
        self._guard.release(self._client)
        self._inner.connection_lost(exc)
