"""One WebSocket connection: bytes ⇄ :class:`~server.frontends.websocket.session.ConnectionProtocol`.

I/O glue only. The reader loop hands each client message to the protocol and
carries out the actions it returns; each attached stream's items are sent by
its own pump task (through the service's one outbox reader), so a stream
waiting on the model never delays another. Every send has a timeout: a
client that stops reading is aborted rather than allowed to hold buffers.
When the connection ends, its unfinished streams are detached, not
cancelled: generation goes on and a new connection may ``resume`` them.
A stream held by another replica is relayed from there by a forwarder task
(``forward.py``), one upstream connection per stream.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from server.frontends.common import SendAborted, ServerInfo, abort_transport, send_within
from server.frontends.lifecycle import end_connection
from server.frontends.websocket.actions import (
    Action,
    Attachment,
    Close,
    Forward,
    Relay,
    Send,
    StartPump,
    StopForward,
    StopPump,
)
from server.frontends.websocket.forward import Forwarder, is_forwarded, upstream_request
from server.frontends.websocket.handoff import Remote
from server.frontends.websocket.session import ConnectionProtocol
from server.metrics import Metrics
from server.streams.items import OutItem
from server.streams.service import SpeechService

#: How long sends of one run may take before the run's deadline is pushed on (``_send_run``).
_PUSH_S = 0.1


class Connection:
    """Serves one client connection until it closes."""

    def __init__(
        self,
        ws: ServerConnection,
        service: SpeechService,
        info: ServerInfo,
        *,
        client: str,
        send_timeout_s: float,
        close_timeout_s: float,
        metrics: Metrics,
    ) -> None:
        self.ws = ws
        self._service = service
        self._send_timeout_s = send_timeout_s
        self._close_timeout_s = close_timeout_s
        self._metrics = metrics
        request = ws.request
        route = request.headers.get("X-Request-ID") if request is not None else None
        forwarded = request is not None and is_forwarded(service.router, request.path, request.headers)
        self.protocol = ConnectionProtocol(
            service, info, client=client, route=route, abort=self.abort, metrics=metrics, forwarded=forwarded
        )
        self._pumps: dict[Attachment, asyncio.Task[None]] = {}
        self._forwards: dict[Remote, tuple[Forwarder, asyncio.Task[None]]] = {}
        self._aborted = False

    @property
    def forwarding(self) -> int:
        """Streams relayed from their owner on this connection now (a drain waits for them)."""
        return len(self._forwards)

    async def run(self) -> None:
        """Say hello, serve messages until the client leaves, then detach every stream."""
        try:
            await self._send(self.protocol.hello())
            async for raw in self.ws:
                await self._carry_out(self.protocol.receive(raw))
        except (ConnectionClosed, SendAborted):
            pass
        finally:
            # The streams are detached before any await, so no cancellation can skip it.
            tasks = [*self._pumps.values(), *(task for _, task in self._forwards.values())]
            await end_connection(self.protocol.connection_lost, tasks)

    def abort(self, reason: str) -> None:
        """Drop the TCP connection at once (no close handshake: the peer is not reading)."""
        if self._aborted:
            return
        self._aborted = True
        abort_transport(self.ws.transport, self._metrics, f"connection from {self.ws.remote_address}", reason)

    async def close_if_idle(self) -> None:
        """During a drain, close with 1012 once no stream is left."""
        await self._carry_out(self.protocol.close_if_idle())

    async def close(self, code: int, reason: str) -> None:
        """Close with ``code``; a client that does not answer within ``--close-timeout-s`` is cut.

        (``websockets`` bounds the wait for the client's close frame, but not a send of the
        close frame to a client whose buffers are full because it stopped reading.)
        """
        try:
            async with asyncio.timeout(self._close_timeout_s):
                await self.ws.close(code, reason)
        except TimeoutError:
            self.abort(f"no answer to the close within {self._close_timeout_s:g} s")

    async def _carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Send):
                await self._send(action.data)
            elif isinstance(action, StartPump):
                attachment = action.attachment
                self._pumps[attachment] = asyncio.create_task(
                    self._pump(attachment, action.index), name=f"pump-{attachment.slot}"
                )
            elif isinstance(action, StopPump):
                pump = self._pumps.pop(action.attachment, None)
                if pump is not None:
                    pump.cancel()
                    await asyncio.gather(pump, return_exceptions=True)
            elif isinstance(action, Close):
                await self.close(action.code, action.reason)
            elif isinstance(action, Forward):
                self._start_forward(action.remote)
            elif isinstance(action, Relay):
                await self._relay(action)
            elif isinstance(action, StopForward):
                entry = self._forwards.pop(action.remote, None)
                if entry is not None:
                    entry[1].cancel()
                    await asyncio.gather(entry[1], return_exceptions=True)

    async def _pump(self, attachment: Attachment, index: int) -> None:
        """Send the stream's items as they come, until ``done`` or the stream moves away."""
        try:
            async with aclosing(attachment.stream.deliver(attachment.lease, index)) as runs:
                async for items in runs:
                    await self._send_run(attachment, items)
        except (ConnectionClosed, SendAborted):
            return
        finally:
            if self._pumps.get(attachment) is asyncio.current_task():
                del self._pumps[attachment]
        await self._carry_out(self.protocol.pump_ended(attachment))

    async def _relay(self, action: Relay) -> None:
        """A client message for a remote stream goes to its owner, or here if the forward ended."""
        entry = self._forwards.get(action.remote)
        if entry is not None:
            if await entry[0].relay(action.data):
                return
            await asyncio.gather(entry[1], return_exceptions=True)  # its end is settled first
        if not self.protocol.relays(action.remote):
            await self._carry_out(self.protocol.receive(action.data))  # served here now, or refused

    def _start_forward(self, remote: Remote) -> None:
        router = self._service.router
        request = self.ws.request
        assert router is not None and request is not None
        peer = str(self.ws.remote_address[0]) if self.ws.remote_address else "?"
        url, headers = upstream_request(
            router, remote.owner, remote.token, request.path, request.headers, peer
        )
        forwarder = Forwarder(
            remote,
            url=url,
            headers=headers,
            timeout_s=self._service.settings.forward_timeout_s,
            send_timeout_s=self._send_timeout_s,
            send=self._send,
            answered=self.protocol.forward_answered,
        )
        task = asyncio.create_task(self._forward(forwarder), name=f"forward-{remote.slot}")
        self._forwards[remote] = (forwarder, task)
        self._metrics.forwarded_streams.inc()

    async def _forward(self, forwarder: Forwarder) -> None:
        """Relay one remote stream until it ends, then let the protocol decide what follows."""
        remote = forwarder.remote
        try:
            outcome = await forwarder.run()
        except (ConnectionClosed, SendAborted):
            return
        finally:
            self._metrics.forwarded_streams.dec()
            if self._forwards.get(remote, (None, None))[1] is asyncio.current_task():
                del self._forwards[remote]
        await self._carry_out(self.protocol.forward_ended(remote, outcome))

    async def _send_run(self, attachment: Attachment, items: list[OutItem]) -> None:
        """Send a run of the stream's items, each within ``--send-timeout-s``, with one timer a run.

        ``websockets`` waits only while its transport is paused (the peer is not reading), so a
        run normally goes out without a pause, and a timer a message (``send_within``) was a
        cost a frame. Here one deadline covers the run and is pushed on whenever a send took
        time: each send still has at least ``--send-timeout-s`` less :data:`_PUSH_S` to finish.
        """
        loop = asyncio.get_running_loop()
        timeout_s = self._send_timeout_s
        audio_bytes = 0
        try:
            async with asyncio.timeout_at(loop.time() + timeout_s) as deadline:
                mark = loop.time()
                for item in items:
                    if self._aborted:
                        raise SendAborted
                    data = self.protocol.render(attachment, item)
                    await self.ws.send(data)
                    if isinstance(data, bytes):
                        audio_bytes += len(data)
                    now = loop.time()
                    if now - mark > _PUSH_S:  # that send waited: the next gets its whole time
                        deadline.reschedule(now + timeout_s)
                        mark = now
        except TimeoutError:
            self.abort(f"send blocked for {timeout_s} s")
            raise SendAborted from None
        finally:  # counted once a run (a counter's lock a frame showed in profiles)
            self._metrics.bytes_sent.inc(audio_bytes)

    async def _send(self, data: str | bytes) -> None:
        if self._aborted:
            raise SendAborted
        await send_within(self.ws.send(data), self._send_timeout_s, self.abort)
