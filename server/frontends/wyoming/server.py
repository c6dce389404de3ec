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
import json
import logging
import socket
from contextlib import aclosing

from wyoming.event import Event, async_write_event

from server.config import Settings
from server.frontends.access import client_identity
from server.frontends.common import SendAborted, abort_transport, send_within
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
from server.streams.service import SpeechService
from server.streams.stream import Lease, Stream

log = logging.getLogger(__name__)
#: How long ``stop`` waits for connections to wind up after their sockets were closed.
STOP_WAIT_S = 5.0


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


class BadEvent(Exception):
    """Bytes that are not a Wyoming event within the bounds."""


async def read_event(reader: asyncio.StreamReader, max_bytes: int) -> Event | None:
    """The next event (None at the end of the connection), never reading more than ``max_bytes``.

    Raises:
        BadEvent: malformed JSON, or a header, data or payload over ``max_bytes``.
    """
    try:
        line = await reader.readline()  # the reader's limit bounds the line
    except ValueError:
        raise BadEvent(f"event header over {max_bytes} bytes") from None
    if not line.endswith(b"\n"):
        return None  # the end of the connection (possibly mid-line)
    try:
        header = json.loads(line)
        kind, data = header["type"], header.get("data") or {}
        data_length = int(header.get("data_length") or 0)
        payload_length = int(header.get("payload_length") or 0)
        if not isinstance(kind, str) or not isinstance(data, dict) or min(data_length, payload_length) < 0:
            raise ValueError("type, data or a length has the wrong type")
        if data_length + payload_length > max_bytes:
            raise ValueError(f"event over {max_bytes} bytes")
        if data_length:
            extra = json.loads(await reader.readexactly(data_length))
            if not isinstance(extra, dict):
                raise ValueError("data is not an object")
            data.update(extra)
        payload = await reader.readexactly(payload_length) if payload_length else None
    except asyncio.IncompleteReadError:
        return None
    except (ValueError, KeyError, TypeError) as exc:
        raise BadEvent(f"not a Wyoming event: {exc}") from None
    return Event(type=kind, data=data, payload=payload)


class WyomingConnection:
    """Serves one Wyoming client until it leaves or the session closes the connection."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        session: WyomingSession,
        service: SpeechService,
        *,
        send_timeout_s: float,
        max_message_bytes: int,
        metrics: Metrics,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.session = session
        self._service = service
        self._send_timeout_s = send_timeout_s
        self._max_bytes = max_message_bytes
        self._metrics = metrics
        self._lock = asyncio.Lock()  # one event at a time on the socket
        self._pump: asyncio.Task[None] | None = None
        self._aborted = False
        self._closed = False

    async def run(self) -> None:
        """Serve events until the client leaves or the connection is closed; free its stream."""
        try:
            while not self._closed:
                try:
                    event = await read_event(self._reader, self._max_bytes)
                except BadEvent as exc:
                    await self._carry_out(self.session.bad_event(str(exc)))
                    break
                if event is None:
                    break
                await self._carry_out(self.session.receive(event))
        except (ConnectionError, SendAborted):
            pass
        finally:
            pump, self._pump = self._pump, None
            if pump is not None:
                pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)
            self.session.connection_lost()
            self._writer.close()

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
        """The server stops: say so to a client with a running stream, then close."""
        if self.session.stream is not None:
            with contextlib.suppress(ConnectionError, SendAborted):
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
        except (ConnectionError, SendAborted):
            self._close()

    async def _write(self, event: Event) -> None:
        if self._aborted:
            raise SendAborted
        async with self._lock:
            await send_within(async_write_event(event, self._writer), self._send_timeout_s, self.abort)
        if event.payload:
            self._metrics.bytes_sent.inc(len(event.payload))

    def _close(self) -> None:
        """Close after what was written (the reader then sees the end and frees the stream)."""
        self._closed = True
        self._writer.close()


class WyomingServer:
    """The Wyoming TCP server, on the app's event loop, over the shared service."""

    def __init__(self, service: SpeechService, settings: Settings, metrics: Metrics) -> None:
        self.service = service
        self.settings = settings
        self.metrics = metrics
        self._seed = settings.wyoming_seed if settings.wyoming_seed >= 0 else None
        self._server: asyncio.Server | None = None
        self._connections: dict[WyomingConnection, asyncio.Task[None]] = {}
        self.port: int | None = None  # bound port once started

    async def start(self, sock: socket.socket) -> None:
        """Serve on ``sock`` (bound by the app, so that a busy port fails before the model loads)."""
        self._server = await asyncio.start_server(
            self._accept, sock=sock, limit=self.settings.max_message_bytes
        )
        self.port = int(sock.getsockname()[1])
        log.info("Wyoming (Home Assistant) on tcp://%s:%d", self.settings.host, self.port)

    async def close_idle(self) -> None:
        """A drain started: close the connections that have no stream."""
        for conn in list(self._connections):
            await conn.close_if_idle()

    async def stop(self) -> None:
        """Stop listening; close every connection (running streams are cut) and wait for them."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            await conn.shut_down()
        tasks = list(self._connections.values())
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=STOP_WAIT_S)
            for conn, task in list(self._connections.items()):
                if task in late:
                    conn.abort("the server is stopping")
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        client = client_identity(None, str(peer[0]) if peer else "?")
        limiter = self.service.limiter
        if len(self._connections) >= self.settings.max_connections or not limiter.open_connection(client):
            self.metrics.errors.labels(code="too_many_connections").inc()
            with contextlib.suppress(ConnectionError):
                await async_write_event(error_event("too_many_connections", "too many connections"), writer)
            writer.close()
            return
        session = WyomingSession(
            self.service,
            wyoming_info(self.service.voice_names()),  # recordings' voices too
            client=client,
            seed=self._seed,
            abort=lambda reason: conn.abort(reason),
            count_error=lambda code: self.metrics.errors.labels(code=code).inc(),
        )
        conn = WyomingConnection(
            reader,
            writer,
            session,
            self.service,
            send_timeout_s=self.settings.send_timeout_s,
            max_message_bytes=self.settings.max_message_bytes,
            metrics=self.metrics,
        )
        task = asyncio.current_task()
        assert task is not None
        self._connections[conn] = task
        try:
            await conn.run()
        finally:
            limiter.close_connection(client)
            del self._connections[conn]
