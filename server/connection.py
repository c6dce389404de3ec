"""One WebSocket connection: bytes ⇄ protocol ⇄ sessions ⇄ scheduler.

The reader loop parses client messages and answers at once (errors,
``started``); each stream's output is sent by its own pump task from the
stream's :class:`~server.session.StreamSession` outbox, so a stream waiting
on the model never delays another. Every send has a timeout: a client that
stops reading is aborted rather than allowed to hold buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from server import protocol
from server.audio import UnsupportedAudio, make_encoder
from server.engine.base import SynthesisParams
from server.protocol import Cancel, ClientMessage, FrameHeader, ProtocolError, Start
from server.scheduler import AudioChunk, ScheduledStream, SegmentStarted, StreamEnded, StreamEvent
from server.session import BufferOverflow, StreamSession
from server.text import has_speakable, split_segments

if TYPE_CHECKING:
    from server.app import App

log = logging.getLogger(__name__)


class _Aborted(Exception):
    """The connection was aborted (send timeout or overflow); stop using it."""


@dataclass(eq=False)
class LiveStream:
    """A stream attached to this connection."""

    slot: int
    session: StreamSession
    handle: ScheduledStream | None = None
    pump: asyncio.Task[None] | None = None
    started_at: float = field(default_factory=time.monotonic)


class Connection:
    """Serves one client connection until it closes."""

    def __init__(self, app: App, ws: ServerConnection) -> None:
        self.app = app
        self.ws = ws
        self.settings = app.settings
        self.streams: dict[str, LiveStream] = {}
        self._aborted = False

    # --- lifecycle -------------------------------------------------------------

    async def run(self) -> None:
        """Say hello, serve messages until the client leaves, then free every stream."""
        try:
            await self._send_json(self.app.hello())
            async for raw in self.ws:
                await self._on_raw(raw)
        except (ConnectionClosed, _Aborted):
            pass
        finally:
            await self._release_all()

    async def _release_all(self) -> None:
        """The connection is gone: cancel its streams (frees engine work) and their pumps."""
        for live in list(self.streams.values()):
            self._cancel_stream(live, notify=False)
        pumps = [live.pump for live in self.streams.values() if live.pump is not None]
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for _ in self.streams:
            self.app.stream_finished("disconnected")
        self.streams.clear()

    def abort(self, reason: str) -> None:
        """Drop the TCP connection at once (no close handshake: the peer is not reading)."""
        if self._aborted:
            return
        self._aborted = True
        log.warning("aborting connection from %s: %s", self.ws.remote_address, reason)
        self.app.metrics.errors.labels(code="aborted").inc()
        self.ws.transport.abort()

    async def close_if_idle_while_draining(self) -> None:
        """During a drain, a connection with no streams left is closed with 1012."""
        if self.app.draining and not self.streams:
            await self.ws.close(1012, "server is restarting")

    # --- receiving ---------------------------------------------------------------

    async def _on_raw(self, raw: str | bytes) -> None:
        try:
            message = protocol.parse_client_message(raw)
            await self._dispatch(message)
        except ProtocolError as err:
            await self._send_error(err)
            if err.code == "shutting_down":
                await self.close_if_idle_while_draining()

    async def _dispatch(self, message: ClientMessage) -> None:
        if isinstance(message, Start):
            await self._start(message)
        elif isinstance(message, Cancel):
            live = self.streams.get(message.id)
            if live is None:
                raise ProtocolError(
                    "bad_request", f"no live stream with id {message.id!r}", stream_id=message.id
                )
            self._cancel_stream(live, notify=True)
        else:
            raise ProtocolError(
                "unsupported", f"message type {message.__class__.__name__.lower()!r} is not available yet"
            )

    async def _start(self, msg: Start) -> None:
        live = self._admit(msg)
        self.streams[msg.id] = live
        session = live.session
        await self._send_json(
            {
                "type": "started",
                "id": msg.id,
                "slot": live.slot,
                "stream": session.token,
                "format": session.encoder.format,
                "sample_rate": session.sample_rate,
                "frame_ms": 20,
            }
        )
        live.pump = asyncio.create_task(self._pump(live), name=f"pump-{msg.id}")

    def _admit(self, msg: Start) -> LiveStream:
        """Validate a ``start`` and submit it; raises ProtocolError with the right code."""
        s = self.settings
        sid = msg.id
        if self.app.draining:
            raise ProtocolError("shutting_down", "the server is draining; reconnect elsewhere", stream_id=sid)
        if sid in self.streams:
            raise ProtocolError("duplicate_id", f"stream id {sid!r} is already live", stream_id=sid)
        if len(self.streams) >= s.max_streams:
            raise ProtocolError(
                "too_many_streams", f"at most {s.max_streams} streams per connection", stream_id=sid
            )
        if msg.incremental:
            raise ProtocolError("unsupported", "incremental streams are not available yet", stream_id=sid)
        if msg.text is None:
            raise ProtocolError("bad_request", "missing field `text`", stream_id=sid)
        if len(msg.text) > s.max_text_chars:
            raise ProtocolError(
                "text_too_long",
                f"text has {len(msg.text)} characters; the limit is {s.max_text_chars}",
                stream_id=sid,
            )
        try:
            encoder = make_encoder(msg.format, msg.sample_rate)
        except UnsupportedAudio as exc:
            raise ProtocolError("unsupported", str(exc), stream_id=sid) from None
        if not self.app.scheduler.validate_voice(msg.voice):
            raise ProtocolError("unsupported", f"unknown voice {msg.voice!r}", stream_id=sid)
        segments = [
            seg for seg in split_segments(msg.text, max_chars=s.segment_max_chars) if has_speakable(seg)
        ]
        if not segments:
            raise ProtocolError("bad_request", "text has nothing to speak", stream_id=sid)
        session = StreamSession(client_id=sid, encoder=encoder, max_unsent_s=s.max_buffered_s)
        live = LiveStream(slot=self._free_slot(), session=session)
        live.handle = self.app.scheduler.submit(
            segments, _params(msg), lambda events: self._on_events(live, events)
        )
        self.app.stream_started()
        return live

    def _free_slot(self) -> int:
        used = {live.slot for live in self.streams.values()}
        return next(slot for slot in range(len(used) + 1) if slot not in used)

    # --- producing -------------------------------------------------------------

    def _on_events(self, live: LiveStream, events: list[StreamEvent]) -> None:
        """Scheduler events for one stream, on the event loop (must not block)."""
        session = live.session
        for event in events:
            if session.ended:
                return
            if isinstance(event, AudioChunk):
                try:
                    session.on_audio(event.audio)
                except BufferOverflow:
                    self._cancel_stream(live, notify=False)
                    self.abort("too much unsent audio")
                    return
            elif isinstance(event, SegmentStarted):
                session.on_segment(event.text)
            elif isinstance(event, StreamEnded):
                if event.error is not None:
                    self.app.metrics.errors.labels(code=event.error.code).inc()
                session.finish(event.reason, event.error)

    def _cancel_stream(self, live: LiveStream, *, notify: bool) -> None:
        if live.handle is not None:
            live.handle.cancel()
        if notify:
            live.session.finish("cancelled")

    # --- sending -----------------------------------------------------------------

    async def _pump(self, live: LiveStream) -> None:
        """Send the stream's items in order as they appear; free the slot after ``done``."""
        session = live.session
        metrics = self.app.metrics
        index = session.sent_index
        try:
            while True:
                item = session.item(index)
                if item is None:
                    if session.ended:
                        break
                    session.changed.clear()
                    await session.changed.wait()
                    continue
                if item.is_frame:
                    header = FrameHeader(
                        flags=item.flags, slot=live.slot, seq=item.position, sample=item.sample
                    )
                    data = protocol.pack_frame(header, item.payload)
                    await self._send(data)
                    if session.first_frame_at is None:
                        session.first_frame_at = time.monotonic()
                        metrics.time_to_first_audio.observe(session.first_frame_at - live.started_at)
                    metrics.frames_sent.inc()
                    metrics.bytes_sent.inc(len(data))
                else:
                    assert item.message is not None
                    await self._send_json({**item.message, "slot": live.slot})
                index += 1
                session.mark_sent(index)
        except (ConnectionClosed, _Aborted):
            return
        self.streams.pop(session.client_id, None)
        self.app.stream_finished(session.done_reason or "error")
        await self.close_if_idle_while_draining()

    async def _send(self, data: str | bytes) -> None:
        if self._aborted:
            raise _Aborted
        try:
            async with asyncio.timeout(self.settings.send_timeout_s):
                await self.ws.send(data)
        except TimeoutError:
            self.abort(f"send blocked for {self.settings.send_timeout_s} s")
            raise _Aborted from None

    async def _send_json(self, message: dict[str, Any]) -> None:
        await self._send(protocol.encode(message))

    async def _send_error(self, err: ProtocolError) -> None:
        self.app.metrics.errors.labels(code=err.code).inc()
        with contextlib.suppress(ConnectionClosed):
            await self._send_json(protocol.error(err))


def _params(msg: Start) -> SynthesisParams:
    """Synthesis parameters of a ``start``; unset sampling controls keep the model's defaults."""
    defaults = SynthesisParams()
    return SynthesisParams(
        voice=msg.voice,
        speed=msg.speed,
        seed=msg.seed,
        temperature=defaults.temperature if msg.temperature is None else msg.temperature,
        top_p=defaults.top_p if msg.top_p is None else msg.top_p,
        top_k=defaults.top_k if msg.top_k is None else msg.top_k,
    )
