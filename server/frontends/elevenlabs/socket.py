"""One ElevenLabs WebSocket on the HTTP API's port: aiohttp frames ⇄ :class:`~.session.ElevenLabsSession`.

I/O glue only. The reader hands each JSON message to the session and carries out the actions
it returns; each context's audio is sent by its own pump task (pulling the stream's items), so
the reader keeps taking text while audio flows, and a client that goes away is seen at once:
its contexts are cancelled and freed. Messages are bounded by ``--max-message-bytes`` (aiohttp
closes with 1009 above it), every send by ``--send-timeout-s``, and a client silent for its
``inactivity_timeout`` (ElevenLabs' query parameter: 20 s by default, at most 180) has its
contexts' text ended, then the socket closed once nothing is left to send.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import aclosing
from typing import Final

import msgspec
from aiohttp import WSMsgType, web

from server.frontends import messages
from server.frontends.common import SendAborted, abort_transport, send_within
from server.frontends.elevenlabs.session import Action, Close, Deliver, ElevenLabsSession, Send
from server.frontends.lifecycle import end_connection
from server.frontends.messages import BadMessage
from server.metrics import Metrics
from server.streams.lifecycle import Lease
from server.streams.stream import Stream

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode
#: Messages are decoded without a type: the session reads their fields (``voice_settings`` typed).
_decoder: Final = msgspec.json.Decoder()


class ElevenLabsSocket:
    """Serves one ElevenLabs WebSocket until the client leaves or the session closes it."""

    def __init__(
        self,
        request: web.Request,
        ws: web.WebSocketResponse,
        session: ElevenLabsSession,
        *,
        send_timeout_s: float,
        inactivity_s: float,
        max_json_depth: int,
        metrics: Metrics,
    ) -> None:
        self._request = request
        self._ws = ws
        self.session = session
        self._send_timeout_s = send_timeout_s
        self._inactivity_s = inactivity_s
        self._max_json_depth = max_json_depth
        self._metrics = metrics
        self._lock = asyncio.Lock()  # one message at a time on the socket
        self._pumps: dict[str, asyncio.Task[None]] = {}
        self._aborted = False
        self._closed = False

    async def run(self) -> None:
        """Serve messages until the client leaves or the socket is closed; free every context."""
        try:
            while not self._closed:
                try:
                    async with asyncio.timeout(self._inactivity_s):
                        message = await self._ws.receive()
                except TimeoutError:
                    self.session.end_inputs()  # ElevenLabs closes a silent client's contexts
                    if not self.session.contexts:
                        await self._close(Close(1000, "inactivity timeout"))
                    continue
                if message.type == WSMsgType.TEXT:
                    await self._carry_out(self._parse(message.data))
                elif message.type == WSMsgType.BINARY:
                    await self._carry_out(self.session.bad_message("send JSON text messages, not binary"))
                else:  # CLOSE, CLOSING, CLOSED, ERROR (a message over the bound closes with 1009)
                    break
        except (ConnectionError, SendAborted):
            pass
        finally:
            # First, before any await: aiohttp cancels this handler when its client goes.
            self._closed = True
            pumps = list(self._pumps.values())
            self._pumps.clear()
            await end_connection(self.session.connection_lost, pumps)
            if not self._ws.closed:
                with contextlib.suppress(ConnectionError):
                    await self._ws.close()

    def _parse(self, data: str) -> list[Action]:
        """One text message through every front end's decoding path (nesting, numbers), then the session."""
        try:
            message = messages.decode(data, _decoder, max_depth=self._max_json_depth)
        except BadMessage as bad:
            return self.session.bad_message(bad.message)
        return self.session.receive(message)

    def abort(self, reason: str) -> None:
        """Drop the TCP connection at once (the peer is not reading)."""
        if self._aborted:
            return
        self._aborted = True
        who = f"ElevenLabs WebSocket from {self._request.remote}"
        abort_transport(self._request.transport, self._metrics, who, reason)

    async def close_if_idle(self) -> None:
        """During a drain, close once no context is left."""
        await self._carry_out(self.session.close_if_idle())

    async def shut_down(self) -> None:
        """The server stops: close now (1012: reconnect elsewhere); running contexts are cut."""
        await self._close(Close(1012, "server is restarting"))

    async def _carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                await self._send(action.message)
            elif isinstance(action, Deliver):
                self._pumps[action.context_id] = asyncio.create_task(
                    self._deliver(action.context_id, action.stream, action.lease), name="elevenlabs-pump"
                )
            else:
                await self._close(action)

    async def _deliver(self, context_id: str, stream: Stream, lease: Lease) -> None:
        """Send a context's audio as it comes, then what the session says to do next."""
        try:
            async with aclosing(stream.deliver(lease, stream.outbox.sent_index)) as runs:
                async for items in runs:
                    for message in self.session.render(context_id, items):
                        await self._send(message)
            if self._pumps.get(context_id) is asyncio.current_task():
                del self._pumps[context_id]
            await self._carry_out(self.session.delivered(context_id))
        except (ConnectionError, SendAborted):
            await self._close(Close(1011, "send failed"))

    async def _send(self, message: dict[str, object]) -> None:
        if self._aborted or self._ws.closed:
            raise SendAborted
        data = _encode(message).decode("utf-8")
        async with self._lock:
            await send_within(self._ws.send_str(data), self._send_timeout_s, self.abort)
        self._metrics.bytes_sent.inc(len(data))

    async def _close(self, close: Close) -> None:
        """Close the socket; the reader then sees the end and frees what is left."""
        self._closed = True
        if not self._ws.closed:
            with contextlib.suppress(ConnectionError):
                await self._ws.close(code=close.code, message=close.reason.encode()[:120])
