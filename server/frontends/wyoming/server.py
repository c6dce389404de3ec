"""The Wyoming server for Home Assistant: TCP bytes ⇄ :class:`~.session.WyomingSession`.

I/O glue only. Each connection's reader hands every event to its session and
carries out the actions it returns; a stream's audio is sent by its own pump
task (through the service's one outbox reader), so the reader keeps taking
``synthesize-chunk`` text while audio flows, and a client that goes away is
seen at once: its stream is cancelled and freed. Events are read with bounds
(header line, data and payload within ``--max-message-bytes``); every write
has ``--send-timeout-s``. Wyoming has no API keys: the client is its IP for
the rate limits and connection caps (see :func:`exposure_problem`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from contextlib import aclosing

from wyoming.event import Event, async_write_event

from server.config import Settings
from server.frontends.access import client_identity
from server.frontends.common import SendAborted, abort_transport, send_within
from server.frontends.lifecycle import end_connection
from server.frontends.ports import GuardedProtocol, PortGuard, peer_ip
from server.frontends.wyoming.events import BadEvent, encode_event, read_event
from server.frontends.wyoming.session import (
    Action,
    Close,
    Deliver,
    Write,
    WyomingSession,
    error_event,
    wyoming_info,
)
from server.metrics import Metrics
from server.streams.lifecycle import Lease
from server.streams.service import SpeechService
from server.streams.stream import Stream

log = logging.getLogger(__name__)


def exposure_problem(settings: Settings, keys_required: bool) -> str | None:
    """Why the Wyoming port must not open as configured, or None.

    Wyoming has no authentication, so with API keys set, an open Wyoming port on a
    non-loopback interface would be a way around them: that takes an explicit
    ``--wyoming-allow-unauthenticated`` (and a firewall or private network).
    """
    if settings.wyoming_port == 0 or not keys_required or settings.wyoming_allow_unauthenticated:
        return None
    host = settings.host
    with contextlib.suppress(ValueError):
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return None
    return (
        f"--wyoming-port {settings.wyoming_port} on --host {host} would serve without API keys "
        "(Wyoming has none): firewall it and pass --wyoming-allow-unauthenticated, "
        "or use a loopback --host, or --wyoming-port 0"
    )


class WyomingConnection:
    """Serves one Wyoming client until it leaves or the session closes the connection.

    Time is bounded three ways: the next event's first byte must come within
    ``--wyoming-idle-timeout-s`` while no audio goes out (idle, or between
    ``synthesize-chunk``s; the deadline moves as streams start and end), the rest of an event
    once begun within ``--header-timeout-s``, and ``synthesize-stop`` within
    ``--wyoming-text-timeout-s`` of its ``synthesize-start``. Each answers ``error`` ``timeout``
    and closes; every write has ``--send-timeout-s``.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        session: WyomingSession,
        settings: Settings,
        metrics: Metrics,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.session = session
        self._settings = settings
        self._metrics = metrics
        self._lock = asyncio.Lock()  # one event at a time on the socket
        self._pump: asyncio.Task[None] | None = None
        self._aborted = False
        self._closed = False
        self._waiting: asyncio.Timeout | None = None  # the wait for the next event's first byte
        self._text_until: float | None = None  # synthesize-stop is due by then

    async def run(self) -> None:
        """Serve events until the client leaves or the connection is closed; free its stream."""
        try:
            while not self._closed:
                try:
                    event = await self._next_event()
                except BadEvent as exc:
                    await self._carry_out(self.session.bad_event(str(exc)))
                    break
                except _TimedOut as exc:
                    await self._carry_out(self.session.timed_out(str(exc)))
                    break
                if event is None:
                    break
                await self._carry_out(self.session.receive(event))
                self._moved()
        except (ConnectionError, SendAborted):
            pass
        finally:
            pump, self._pump = self._pump, None
            await end_connection(self._lost, [] if pump is None else [pump])

    def _lost(self) -> None:
        """The connection ends: free its stream, close the socket (runs before any await)."""
        self._closed = True
        try:
            self.session.connection_lost()
        finally:
            self._writer.close()

    async def _next_event(self) -> Event | None:
        """The next event within its deadlines (None at the end of the connection).

        Raises:
            BadEvent: not an event within the bounds.
            _TimedOut: a deadline passed (the message says which).
        """
        s = self._settings
        try:
            async with asyncio.timeout_at(self._deadline()) as self._waiting:
                first = await self._reader.read(1)
        except TimeoutError:
            if self._text_until is not None and asyncio.get_running_loop().time() >= self._text_until:
                raise _TimedOut(
                    f"no synthesize-stop within {s.wyoming_text_timeout_s:g} s of synthesize-start "
                    "(--wyoming-text-timeout-s)"
                ) from None
            idle = s.wyoming_idle_timeout_s
            raise _TimedOut(f"no event for {idle:g} s (--wyoming-idle-timeout-s)") from None
        finally:
            self._waiting = None
        if not first:
            return None
        try:
            async with asyncio.timeout(s.header_timeout_s):
                return await read_event(
                    self._reader, first, max_bytes=s.max_message_bytes, max_depth=s.max_json_depth
                )
        except TimeoutError:
            message = f"an event took over {s.header_timeout_s:g} s to arrive (--header-timeout-s)"
            raise _TimedOut(message) from None

    def _deadline(self) -> float | None:
        """When the next event must have begun: none while audio goes out to a client that waits."""
        session, now = self.session, asyncio.get_running_loop().time()
        if session.stream is not None and not session.taking_text:
            return None
        deadline = now + self._settings.wyoming_idle_timeout_s
        return deadline if self._text_until is None else min(deadline, self._text_until)

    def _moved(self) -> None:
        """The session's state may have changed: start or stop the text clock, move the wait's deadline."""
        if self.session.taking_text and self._text_until is None:
            self._text_until = asyncio.get_running_loop().time() + self._settings.wyoming_text_timeout_s
        elif not self.session.taking_text:
            self._text_until = None
        if self._waiting is not None:
            self._waiting.reschedule(self._deadline())

    def abort(self, reason: str) -> None:
        """Drop the TCP connection at once (the peer is not reading)."""
        if self._aborted:
            return
        self._aborted = True
        who = f"Wyoming connection from {self._writer.get_extra_info('peername')}"
        abort_transport(self._writer.transport, self._metrics, who, reason)

    async def close_if_idle(self) -> None:
        """During a drain, close once no stream is left."""
        await self._carry_out(self.session.close_if_idle())

    async def shut_down(self) -> None:
        """The server stops: tell a client with a running stream (within ``--close-timeout-s``), close."""
        if self.session.stream is not None:
            with contextlib.suppress(ConnectionError, SendAborted, TimeoutError):
                async with asyncio.timeout(self._settings.close_timeout_s):
                    await self._write(error_event("shutting_down", "the server is stopping"))
        self._close()

    async def _carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Write):
                await self._write(action.event)
            elif isinstance(action, Deliver):
                self._pump = asyncio.create_task(
                    self._deliver(action.stream, action.lease), name="wyoming-pump"
                )
            elif isinstance(action, Close):
                self._close()

    async def _deliver(self, stream: Stream, lease: Lease) -> None:
        """Send the stream's audio as it comes, then what the session says to do next."""
        try:
            async with aclosing(stream.deliver(lease, stream.outbox.sent_index)) as runs:
                async for items in runs:
                    for event in self.session.render(items):
                        await self._write(event)
            if self._pump is asyncio.current_task():
                self._pump = None
            await self._carry_out(self.session.delivered())
            self._moved()  # no audio goes out any more: the idle clock runs
        except (ConnectionError, SendAborted):
            self._close()

    async def _write(self, event: Event) -> None:
        if self._aborted:
            raise SendAborted
        async with self._lock:
            timeout = self._settings.send_timeout_s
            await send_within(async_write_event(event, self._writer), timeout, self.abort)
        if event.payload:
            self._metrics.bytes_sent.inc(len(event.payload))

    def _close(self) -> None:
        """Close after what was written (the reader then sees the end and frees the stream)."""
        self._closed = True
        self._writer.close()


class _TimedOut(Exception):
    """A deadline of the connection passed (the message names it and its flag)."""


class WyomingServer:
    """The Wyoming TCP server, on the app's event loop, over the shared service.

    Its connections are held to ``guard`` (the port's caps, per client by IP): one over a
    cap reads an ``error`` ``too_many_connections`` event and is closed.
    """

    def __init__(
        self, service: SpeechService, settings: Settings, metrics: Metrics, guard: PortGuard
    ) -> None:
        self.service = service
        self.settings = settings
        self.metrics = metrics
        self.guard = guard
        self._seed = settings.wyoming_seed if settings.wyoming_seed >= 0 else None
        self._server: asyncio.Server | None = None
        self._connections: dict[WyomingConnection, asyncio.Task[None]] = {}
        self.port: int | None = None  # bound port once started

    async def start(self, sock: socket.socket) -> None:
        """Serve on ``sock`` (bound by the app, so that a busy port fails before the model loads)."""

        def refusal(why: str) -> bytes:
            return encode_event(error_event("too_many_connections", f"{why}; retry later"))

        def connection() -> asyncio.Protocol:
            reader = asyncio.StreamReader(limit=self.settings.max_message_bytes)
            inner = asyncio.StreamReaderProtocol(reader, self._accept)
            return GuardedProtocol(inner, self.guard, refusal, per_client=True)

        self._server = await asyncio.get_running_loop().create_server(connection, sock=sock)
        self.port = int(sock.getsockname()[1])
        log.info("Wyoming (Home Assistant) on tcp://%s:%d", self.settings.host, self.port)

    async def close_idle(self) -> None:
        """A drain started: close the connections that have no stream."""
        idle = [conn.close_if_idle() for conn in list(self._connections)]
        await asyncio.gather(*idle, return_exceptions=True)

    async def stop(self) -> None:
        """Stop listening; close every connection at once (running streams are cut), each bounded.

        A client with a running stream is told ``shutting_down`` (each write within
        ``--close-timeout-s``); connections still open after another ``--close-timeout-s`` are cut.
        """
        if self._server is not None:
            self._server.close()
        await asyncio.gather(*(conn.shut_down() for conn in list(self._connections)), return_exceptions=True)
        tasks = list(self._connections.values())
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self.settings.close_timeout_s)
            for conn, task in list(self._connections.items()):
                if task in late:
                    conn.abort("the server is stopping")
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = client_identity(None, peer_ip(writer.transport))  # admitted by the guard already
        session = WyomingSession(
            self.service,
            wyoming_info(self.service.catalog.entries()),  # recordings' voices too
            client=client,
            seed=self._seed,
            abort=lambda reason: conn.abort(reason),
            count_error=lambda code: self.metrics.errors.labels(code=code).inc(),
        )
        conn = WyomingConnection(reader, writer, session, self.settings, self.metrics)
        task = asyncio.current_task()
        assert task is not None
        self._connections[conn] = task
        try:
            await conn.run()
        finally:
            del self._connections[conn]
