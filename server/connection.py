"""One WebSocket connection: bytes ⇄ protocol ⇄ streams.

The reader loop parses client messages and answers at once (errors,
``started``, ``resumed``); each attached stream's items are sent by its own
pump task from the stream's replay buffer, so a stream waiting on the model
never delays another. Every send has a timeout: a client that stops reading
is aborted rather than allowed to hold buffers. When the connection ends,
its unfinished streams are detached, not cancelled: generation goes on and
a new connection may ``resume`` them within the TTL.
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
from server.audio import opus_preskip
from server.incremental import TextFeed
from server.protocol import Cancel, ClientMessage, FrameHeader, ProtocolError, Resume, Start
from server.session import redact
from server.streams import Stream

if TYPE_CHECKING:
    from server.app import App

log = logging.getLogger(__name__)


class _Aborted(Exception):
    """The connection was aborted (send timeout or overflow); stop using it."""


@dataclass(eq=False)
class Attachment:
    """A stream attached to this connection under a slot."""

    stream: Stream
    slot: int
    pump: asyncio.Task[None] | None = None
    attached_at: float = field(default_factory=time.monotonic)


class Connection:
    """Serves one client connection until it closes."""

    def __init__(self, app: App, ws: ServerConnection, client: str) -> None:
        self.app = app
        self.client = client  # rate-limit identity: an API-key digest or the IP
        self.ws = ws
        self.settings = app.settings
        self.service = app.service
        self.attached: dict[str, Attachment] = {}  # by the client's stream id
        self._aborted = False

    # --- lifecycle -------------------------------------------------------------

    async def run(self) -> None:
        """Say hello, serve messages until the client leaves, then detach every stream."""
        try:
            await self._send_json(self.app.hello())
            async for raw in self.ws:
                await self._on_raw(raw)
        except (ConnectionClosed, _Aborted):
            pass
        finally:
            for attachment in list(self.attached.values()):
                await self._detach(attachment, connection_lost=True)

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
        if self.app.draining and not self.attached:
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
            attachment = self.attached.get(message.id)
            if attachment is None:
                raise ProtocolError(
                    "bad_request", f"no live stream with id {message.id!r}", stream_id=message.id
                )
            attachment.stream.cancel()
        elif isinstance(message, Resume):
            await self._resume(message)
        else:
            self._text_feed(message.id).apply(message)

    def _text_feed(self, sid: str) -> TextFeed:
        attachment = self.attached.get(sid)
        if attachment is None:
            raise ProtocolError("bad_request", f"no live stream with id {sid!r}", stream_id=sid)
        feed = attachment.stream.text_feed
        if feed is None:
            raise ProtocolError(
                "bad_request", f"stream {sid!r} was not started with `incremental`", stream_id=sid
            )
        return feed

    def _check_room(self, sid: str) -> None:
        if sid in self.attached:
            raise ProtocolError("duplicate_id", f"stream id {sid!r} is already live", stream_id=sid)
        if len(self.attached) >= self.settings.max_streams:
            raise ProtocolError(
                "too_many_streams",
                f"at most {self.settings.max_streams} streams per connection",
                stream_id=sid,
            )

    async def _start(self, msg: Start) -> None:
        self.service.check_accepting(msg.id)  # before the rate limiter takes a token
        self.service.check_rate(self.client, msg.id)
        self._check_room(msg.id)
        request = self.ws.request
        route = request.headers.get("X-Request-ID") if request is not None else None
        stream = self.service.open(msg, self, self._on_overflow, route=route)
        attachment = self._attach(stream)
        session = stream.session
        await self._send_json(
            {
                "type": "started",
                "id": msg.id,
                "slot": attachment.slot,
                "stream": session.token,
                "format": session.format,
                "sample_rate": session.sample_rate,
                "frame_ms": 20,
                **_preskip(stream),
            }
        )
        self._start_pump(attachment, session.sent_index)

    async def _resume(self, msg: Resume) -> None:
        stream = self.service.registry.get(msg.stream)
        if stream is None:
            raise ProtocolError("unknown_stream", "no stream with this token is held here", token=msg.stream)
        session = stream.session
        previous = session.owner
        # Check everything before touching the stream's current attachment.
        try:
            session.check_resumable(msg.after_seq)
        except ProtocolError as err:
            err.stream_id, err.token = session.client_id, msg.stream
            raise
        if previous is not self:
            self._check_room(session.client_id)
        if isinstance(previous, Connection):
            # The stream moves here; the old attachment stops getting frames.
            await previous.release(stream)
        index = session.rewind_to(msg.after_seq)
        self.service.registry.attach(stream, self)
        attachment = self._attach(stream)
        log.info("stream %s resumed after seq %d", redact(stream.token), msg.after_seq)
        await self._send_json(
            {
                "type": "resumed",
                "id": session.client_id,
                "slot": attachment.slot,
                "stream": session.token,
                "after_seq": msg.after_seq,
                "format": session.format,
                "sample_rate": session.sample_rate,
                **_preskip(stream),
            }
        )
        self._start_pump(attachment, index)

    def _attach(self, stream: Stream) -> Attachment:
        used = {a.slot for a in self.attached.values()}
        slot = next(n for n in range(len(used) + 1) if n not in used)
        attachment = Attachment(stream, slot)
        self.attached[stream.session.client_id] = attachment
        return attachment

    async def release(self, stream: Stream) -> None:
        """Stop sending ``stream`` here (it is moving to another connection)."""
        attachment = self.attached.pop(stream.session.client_id, None)
        if attachment is not None and attachment.pump is not None:
            attachment.pump.cancel()
            await asyncio.gather(attachment.pump, return_exceptions=True)
        self.service.registry.detach(stream)

    async def _detach(self, attachment: Attachment, *, connection_lost: bool) -> None:
        """The connection is gone: keep the stream for resume, or free it."""
        self.attached.pop(attachment.stream.session.client_id, None)
        if attachment.pump is not None:
            attachment.pump.cancel()
            await asyncio.gather(attachment.pump, return_exceptions=True)
        stream = attachment.stream
        if stream.session.owner is not self:
            return  # already moved to another connection
        if self.service.registry.ttl_s <= 0:
            await self.service.forget(stream)
            return
        self.service.registry.detach(stream)
        if connection_lost:
            log.info(
                "stream %s detached; resumable for %.0f s", redact(stream.token), self.service.registry.ttl_s
            )

    def _on_overflow(self, stream: Stream) -> None:
        owner = stream.session.owner
        if isinstance(owner, Connection):
            owner.abort("too much unsent audio")

    # --- sending -----------------------------------------------------------------

    def _start_pump(self, attachment: Attachment, index: int) -> None:
        attachment.pump = asyncio.create_task(self._pump(attachment, index), name=f"pump-{attachment.slot}")

    async def _pump(self, attachment: Attachment, index: int) -> None:
        """Send the stream's items in order as they appear; free it after ``done``."""
        stream = attachment.stream
        session = stream.session
        metrics = self.app.metrics
        try:
            while (item := await session.wait_item(index)) is not None:
                if item.is_frame:
                    header = FrameHeader(
                        flags=item.flags, slot=attachment.slot, seq=item.position, sample=item.sample
                    )
                    data = protocol.pack_frame(header, item.payload)
                    await self._send(data)
                    if session.first_frame_at is None:
                        session.first_frame_at = time.monotonic()
                        metrics.time_to_first_audio.observe(session.first_frame_at - session.created)
                    metrics.frames_sent.inc()
                    metrics.bytes_sent.inc(len(data))
                else:
                    assert item.message is not None
                    await self._send_json({**item.message, "slot": attachment.slot})
                index += 1
                session.mark_sent(index)
        except (ConnectionClosed, _Aborted):
            return
        self.attached.pop(session.client_id, None)
        if stream.error_code is not None:
            metrics.errors.labels(code=stream.error_code).inc()
        self.service.delivered(stream)
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
        with contextlib.suppress(ConnectionClosed, _Aborted):
            await self._send_json(protocol.error(err))


def _preskip(stream: Stream) -> dict[str, int]:
    """``preskip`` for raw Opus streams: decoded samples a client drops at the start."""
    preskip = opus_preskip(stream.encoder)
    return {"preskip": preskip} if preskip else {}
