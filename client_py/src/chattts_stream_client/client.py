"""The asyncio client: one WebSocket shared by any number of streams, reconnect and resume.

Opening a connection is :func:`~chattts_stream_client.handshake.handshake`; routing what the
server sends to each stream is :class:`~chattts_stream_client.demux.Demux`. The client owns the
connection's lifetime: when to open one, the reader, and reconnecting to resume its streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import random
import time
from collections.abc import Coroutine
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from chattts_stream_client.demux import Demux
from chattts_stream_client.errors import ChatTTSStreamError, ConnectionLost, ProtocolViolation
from chattts_stream_client.handshake import handshake
from chattts_stream_client.stream import SpeechStream
from chattts_stream_client.wire import stream_url

log = logging.getLogger(__name__)
_ids = itertools.count()


class Client:
    """A chattts-stream client: ``async with Client(url) as c:``, then :meth:`speak` or :meth:`open_stream`.

    Streams share one WebSocket connection (up to the server's ``max_streams``).
    When the connection is lost, the client reconnects with backoff within the
    server's ``resume_ttl_s`` and resumes every unfinished stream after the last
    frame it took: no gap, no duplicate. Every wait is bounded: ``connect_timeout``
    for a connection and its ``hello``, ``read_timeout`` for a stream's next
    chunk (which covers a reconnect).
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        resume: bool = True,
        reconnect_delays: tuple[float, float] = (0.1, 2.0),
        max_queued_chunks: int = 6000,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Configure the client (nothing connects until :meth:`connect` or the first stream).

        Args:
            url: ``ws://host:port/v1/stream`` (an ``http://host:port`` origin or
                ``host:port`` works too).
            api_key: sent as ``Authorization: Bearer`` when the server wants keys.
            connect_timeout: seconds for the TCP/WebSocket handshake plus ``hello``.
            read_timeout: longest wait for a stream's next chunk or answer.
            resume: reconnect and resume streams after a lost connection.
            reconnect_delays: first and longest backoff delay in seconds (doubling,
                ±20 % jitter), until the server's ``resume_ttl_s`` is spent.
            max_queued_chunks: chunks a stream holds for a consumer that lags; when
                full, reading pauses (TCP pushes back on the server) instead of
                growing without bound.
            headers: extra handshake headers (e.g. ``X-Request-ID``).
        """
        self.url = stream_url(url)
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.resume = resume
        self.reconnect_delays = reconnect_delays
        self.max_queued_chunks = max_queued_chunks
        self._headers = dict(headers or {})
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.hello: dict[str, Any] | None = None
        self._last_hello: dict[str, Any] = {}
        #: Connections opened so far (1 + reconnects).
        self.connections = 0
        self._ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._reconnect: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._connect_lock = asyncio.Lock()
        self._demux = Demux(self._spawn)
        self._lost_at: float | None = None
        self._closed = False

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- public API ----------------------------------------------------------------

    async def connect(self) -> dict[str, Any]:
        """Connect now if not connected; returns the server's ``hello`` (voices, formats, limits).

        Raises:
            ConnectionLost: the server cannot be reached or refused the upgrade.
            StreamTimeout: no ``hello`` within ``connect_timeout``.
        """
        reconnecting = self._reconnect
        if reconnecting is not None and not reconnecting.done():
            # A reconnect is under way: its connection is the one to use.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.connect_timeout):
                    await asyncio.shield(reconnecting)
        async with self._connect_lock:
            if self._closed:
                raise RuntimeError("the client is closed")
            if self._ws is None:
                await self._open()
            assert self.hello is not None
            return self.hello

    def speak(
        self,
        text: str,
        *,
        voice: str | None = None,
        format: str = "pcm16",
        sample_rate: int | None = None,
        speed: float | None = None,
        seed: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        stream_id: str | None = None,
        frame_ms: int | None = None,
        **extra: Any,
    ) -> SpeechStream:
        """A stream speaking ``text``; it starts when first iterated (or on ``await stream.start()``).

        Keyword arguments are the ``start`` fields of docs/protocol.md; ``extra``
        passes fields this version does not name. ``frame_ms`` (20, 40 or 60; None: the
        server's 20) asks for longer frames: fewer messages for the same audio (pcm16, f32,
        mulaw, opus).
        """
        fields = dict(voice=voice, format=format, sample_rate=sample_rate, speed=speed, seed=seed)
        fields |= dict(temperature=temperature, top_p=top_p, top_k=top_k, text=text, frame_ms=frame_ms)
        fields |= extra
        return self._stream(stream_id, fields)

    async def open_stream(
        self,
        text: str = "",
        *,
        voice: str | None = None,
        format: str = "pcm16",
        sample_rate: int | None = None,
        seed: int | None = None,
        max_buffer_delay_ms: int | None = None,
        stream_id: str | None = None,
        frame_ms: int | None = None,
        **extra: Any,
    ) -> SpeechStream:
        """Start an incremental stream: feed it with ``append``/``flush``/``end`` while iterating its audio.

        Raises:
            ChatTTSStreamError: the server refused the stream.
        """
        fields = dict(voice=voice, format=format, sample_rate=sample_rate, seed=seed, incremental=True)
        fields |= dict(max_buffer_delay_ms=max_buffer_delay_ms, text=text or None, frame_ms=frame_ms)
        fields |= extra
        return await self._stream(stream_id, fields).start()

    async def synthesize(self, text: str, **options: Any) -> bytes:
        """Speak ``text`` and return all of its audio (see :meth:`speak` for the options)."""
        return await self.speak(text, **options).read_all()

    async def close(self) -> None:
        """Cancel every unfinished stream and close the connection."""
        self._closed = True
        for stream in list(self._demux.streams.values()):
            await stream.cancel()
        tasks = [t for t in (self._reconnect, self._reader, *self._tasks) if t is not None]
        ws, self._ws = self._ws, None
        if ws is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.connect_timeout):
                    await ws.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- streams ---------------------------------------------------------------------

    def _stream(self, stream_id: str | None, fields: dict[str, Any]) -> SpeechStream:
        if self._closed:
            raise RuntimeError("the client is closed")
        sid = stream_id or f"py{next(_ids)}"
        if sid in self._demux.streams:
            raise ValueError(f"stream id {sid!r} is live on this client")
        start = {"type": "start", "id": sid} | {k: v for k, v in fields.items() if v is not None}
        stream = SpeechStream(self, sid, start, self.max_queued_chunks)
        self._demux.streams[sid] = stream
        return stream

    async def _launch(self, stream: SpeechStream) -> None:
        """Send a pending stream's ``start`` (connecting first if needed)."""
        await self.connect()
        if stream.phase != "pending":
            return
        stream.phase = "starting"
        if self._ws is not None:
            await stream._restart()
        # else: lost meanwhile; the reconnect sends it

    def _forget(self, stream: SpeechStream) -> None:
        self._demux.forget(stream)

    async def _send(self, message: dict[str, Any]) -> None:
        ws = self._ws
        if ws is None:
            return  # the stream is resumed or restarted on the next connection
        try:
            async with asyncio.timeout(self.connect_timeout):
                await ws.send(json.dumps(message, ensure_ascii=False))
        except (ConnectionClosed, TimeoutError):
            ws.transport.abort()  # the reader sees the loss and reconnects

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- the connection ------------------------------------------------------------

    async def _open(self) -> None:
        ws, hello = await handshake(self.url, self._headers, self.connect_timeout)
        self._ws, self.hello, self._last_hello = ws, hello, hello
        self.connections += 1
        self._demux.new_connection()
        self._reader = asyncio.create_task(self._read(ws), name="chattts-stream-reader")

    async def _read(self, ws: ClientConnection) -> None:
        try:
            async for raw in ws:
                if isinstance(raw, bytes):
                    await self._demux.on_frame(raw)
                else:
                    self._demux.on_message(json.loads(raw))
        except ConnectionClosed:
            pass
        except (ProtocolViolation, ValueError, KeyError, TypeError) as exc:
            log.warning("protocol violation, reconnecting: %s", exc)
            ws.transport.abort()
        finally:
            if self._ws is ws:
                self._lost(ws)

    def _lost(self, ws: ClientConnection) -> None:
        """The connection is gone: detach its streams and reconnect if any must resume."""
        self._ws, self.hello = None, None
        waiting = self._demux.detach()
        if self._closed or not waiting:
            return
        if not self.resume:
            for stream in waiting:
                self._demux.fail(stream, ConnectionLost("the connection closed", stream_id=stream.id))
            return
        self._lost_at = self._lost_at or time.monotonic()
        self._reconnect = asyncio.create_task(self._reconnect_loop(), name="chattts-stream-reconnect")

    async def _reconnect_loop(self) -> None:
        try:
            await self._reconnect_until_deadline()
        except Exception as exc:  # never die silently: the streams waiting on it must hear
            log.exception("reconnect failed")
            for stream in [s for s in self._demux.streams.values() if not s.finished]:
                self._demux.fail(stream, ConnectionLost(f"reconnect failed: {exc!r}", stream_id=stream.id))

    async def _reconnect_until_deadline(self) -> None:
        assert self._lost_at is not None
        deadline = self._lost_at + float(self._last_hello.get("resume_ttl_s", 30))
        delay, longest = self.reconnect_delays
        while not self._closed:
            try:
                async with self._connect_lock:
                    if self._ws is None:
                        await self._open()
                break
            except ChatTTSStreamError as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    for stream in [s for s in self._demux.streams.values() if not s.finished]:
                        message = f"could not reconnect within the resume TTL: {exc.message}"
                        self._demux.fail(stream, ConnectionLost(message, stream_id=stream.id))
                    self._lost_at = None
                    return
                await asyncio.sleep(min(left, delay * random.uniform(0.8, 1.2)))  # jitter, not crypto
                delay = min(longest, delay * 2)
        self._lost_at = None
        await self._reattach()

    async def _reattach(self) -> None:
        """On a fresh connection: resume streams that have a token, start again those that had none."""
        for stream in list(self._demux.streams.values()):
            if stream.phase == "detached":
                self._demux.resume_sent(stream)
                await self._send(stream._resume_message())
            elif stream.phase == "starting":
                await stream._restart()
