"""The asyncio client: one WebSocket shared by any number of streams, reconnect and resume."""

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

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from chattts_stream_client.errors import (
    ChatTTSStreamError,
    ConnectionLost,
    ProtocolViolation,
    StreamTimeout,
    Unauthorized,
    error_from,
)
from chattts_stream_client.stream import SpeechStream
from chattts_stream_client.wire import parse_frame, stream_url

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
        self._streams: dict[str, SpeechStream] = {}
        self._by_slot: dict[int, SpeechStream] = {}
        self._resuming: list[SpeechStream] = []  # resumes sent, not yet answered, in order
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
        for stream in list(self._streams.values()):
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
        if sid in self._streams:
            raise ValueError(f"stream id {sid!r} is live on this client")
        start = {"type": "start", "id": sid} | {k: v for k, v in fields.items() if v is not None}
        stream = SpeechStream(self, sid, start, self.max_queued_chunks)
        self._streams[sid] = stream
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
        self._streams.pop(stream.id, None)
        if stream.slot is not None and self._by_slot.get(stream.slot) is stream:
            del self._by_slot[stream.slot]

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
        try:
            ws = await connect(
                self.url,
                additional_headers=self._headers,
                compression=None,
                max_size=2**24,
                open_timeout=self.connect_timeout,
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
            raise ConnectionLost(f"cannot connect to {self.url}: {exc!r}") from exc
        try:
            async with asyncio.timeout(self.connect_timeout):
                hello = json.loads(await ws.recv())
        except TimeoutError:
            ws.transport.abort()
            raise StreamTimeout(f"no hello from {self.url} within {self.connect_timeout} s") from None
        except (ConnectionClosed, ValueError) as exc:
            ws.transport.abort()
            if isinstance(exc, ConnectionClosed) and exc.rcvd is not None and exc.rcvd.code == 1008:
                raise Unauthorized(f"the server closed the connection: {exc.rcvd.reason}") from None
            raise ConnectionLost(f"bad greeting from {self.url}: {exc}") from exc
        if not isinstance(hello, dict) or hello.get("type") != "hello":
            ws.transport.abort()
            raise ProtocolViolation(f"expected hello, got {hello!r}")
        self._ws, self.hello, self._last_hello = ws, hello, hello
        self.connections += 1
        self._by_slot.clear()
        self._resuming = []
        self._reader = asyncio.create_task(self._read(ws), name="chattts-stream-reader")

    async def _read(self, ws: ClientConnection) -> None:
        try:
            async for raw in ws:
                if isinstance(raw, bytes):
                    await self._on_frame(raw)
                else:
                    self._on_message(json.loads(raw))
        except ConnectionClosed:
            pass
        except (ProtocolViolation, ValueError, KeyError, TypeError) as exc:
            log.warning("protocol violation, reconnecting: %s", exc)
            ws.transport.abort()
        finally:
            if self._ws is ws:
                self._lost(ws)

    async def _on_frame(self, raw: bytes) -> None:
        received = time.perf_counter()
        header, payload = parse_frame(raw)
        stream = self._by_slot.get(header.slot)
        if stream is None:
            raise ProtocolViolation(f"frame for slot {header.slot}, which no stream holds")
        await stream._on_frame(header, payload, received)

    def _on_message(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        stream = self._streams.get(message["id"]) if isinstance(message.get("id"), str) else None
        if kind == "started" and stream is not None:
            stream._on_started(message)
            self._by_slot[stream.slot] = stream  # type: ignore[index]
        elif kind == "resumed" and stream is not None:
            if stream in self._resuming:
                self._resuming.remove(stream)
            stream._on_resumed(message)
            self._by_slot[stream.slot] = stream  # type: ignore[index]
            self._spawn(stream._send_text())
        elif kind == "segment" and stream is not None:
            stream._on_segment(message)
        elif kind == "words" and stream is not None:
            stream._on_words(message)
        elif kind == "resume_degraded" and stream is not None:
            stream.degraded = str(message.get("reason", "the audio may differ"))
            log.warning("stream %s resumed, but its audio may differ: %s", stream.id, stream.degraded)
        elif kind == "done" and stream is not None:
            stream._on_done(message)
            self._forget(stream)
        elif kind == "error":
            self._on_error(message, stream)

    def _on_error(self, message: dict[str, Any], stream: SpeechStream | None) -> None:
        error = error_from(message)
        token = message.get("stream")
        resumed = next((s for s in self._resuming if s.token == token), None) if token is not None else None
        if resumed is not None:
            # unknown_stream / resume_expired answer a resume: that stream cannot come back.
            self._resuming.remove(resumed)
            self._fail(resumed, error)
            return
        if stream is None:
            log.warning("server error: %s", error)
            return
        stream._on_error(error)
        if stream.finished:
            self._forget(stream)

    def _lost(self, ws: ClientConnection) -> None:
        """The connection is gone: detach its streams and reconnect if any must resume."""
        self._ws, self.hello = None, None
        self._by_slot.clear()
        self._resuming = []
        waiting = [s for s in self._streams.values() if not s.finished and s.phase != "pending"]
        for stream in waiting:
            stream.phase = "detached" if stream.token is not None else "starting"
        if self._closed or not waiting:
            return
        if not self.resume:
            for stream in waiting:
                self._fail(stream, ConnectionLost("the connection closed", stream_id=stream.id))
            return
        self._lost_at = self._lost_at or time.monotonic()
        self._reconnect = asyncio.create_task(self._reconnect_loop(), name="chattts-stream-reconnect")

    def _fail(self, stream: SpeechStream, error: ChatTTSStreamError) -> None:
        stream._fail_with(error)
        self._forget(stream)

    async def _reconnect_loop(self) -> None:
        try:
            await self._reconnect_until_deadline()
        except Exception as exc:  # never die silently: the streams waiting on it must hear
            log.exception("reconnect failed")
            for stream in [s for s in self._streams.values() if not s.finished]:
                self._fail(stream, ConnectionLost(f"reconnect failed: {exc!r}", stream_id=stream.id))

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
                    for stream in [s for s in self._streams.values() if not s.finished]:
                        message = f"could not reconnect within the resume TTL: {exc.message}"
                        self._fail(stream, ConnectionLost(message, stream_id=stream.id))
                    self._lost_at = None
                    return
                await asyncio.sleep(min(left, delay * random.uniform(0.8, 1.2)))  # jitter, not crypto
                delay = min(longest, delay * 2)
        self._lost_at = None
        await self._reattach()

    async def _reattach(self) -> None:
        """On a fresh connection: resume streams that have a token, start again those that had none."""
        for stream in list(self._streams.values()):
            if stream.phase == "detached":
                self._resuming.append(stream)
                await self._send(stream._resume_message())
            elif stream.phase == "starting":
                await stream._restart()
