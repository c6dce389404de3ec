"""A resume forwarded to the replica that owns its stream, and the stream relayed back to the client.

Why forward rather than tell the client where to reconnect (Discord's ``resume_url``): behind
a plain Kubernetes Service, a Gateway API route or a cloud load balancer without stickiness,
a client reaches *some* replica and can never pick a pod; the pods reach each other on the pod
network. So the replica a resume lands on opens one WebSocket to the owner (the address in
the signed token, checked against ``--forward-allow`` by ``server.streams.routing`` before
any connection), sends the client's ``resume`` there, and relays the stream both ways under
this connection's slot. The client sees what a resume on the owner would have shown it.

The upstream handshake carries the client's credentials (``Authorization``, ``X-API-Key``,
``?api_key=``, ``Origin``), so the owner applies the same access rules, and a proof made
with the shared key (``X-Chattts-Forwarded``), so the owner serves it while draining and
never forwards it again. Every wait is bounded: connect, ``hello`` and the answer to the
resume within ``--forward-timeout-s``; each send either way within ``--send-timeout-s``;
the owner's messages at most 1 MiB, 16 queued (then TCP pushes back on the owner).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from urllib.parse import parse_qs, quote, urlsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from server.frontends.common import SendAborted, send_within
from server.frontends.websocket import wire
from server.frontends.websocket.handoff import (
    Finished,
    Lost,
    Outcome,
    PassOn,
    Refused,
    Remote,
    Unreachable,
    reslot_frame,
    reslot_message,
)
from server.frontends.websocket.routes import STREAM_PATH
from server.streams.routing import Router
from server.streams.tokens import redact

log = logging.getLogger(__name__)

#: The handshake header that proves a connection comes from another replica.
FORWARD_HEADER = "X-Chattts-Forwarded"
#: The largest message an owner sends (a frame, a ``resumed``): far above any real one.
UPSTREAM_MAX_BYTES = 1 << 20
#: Owner messages buffered before reading pauses (TCP then pushes back on the owner).
UPSTREAM_QUEUE = 16
_COPIED_HEADERS = ("Authorization", "X-API-Key", "Origin", "X-Request-ID")

Sender = Callable[[str | bytes], Awaitable[None]]


def is_forwarded(router: Router | None, path: str, headers: Mapping[str, str]) -> bool:
    """Whether a handshake comes from another replica (a fresh proof for its ``?resume=`` token).

    A handshake without the header costs nothing more; a repeated header is no proof (the
    ``websockets`` headers raise on ``get`` of a repeated name).
    """
    if router is None:
        return False
    try:
        proof = headers.get(FORWARD_HEADER)
    except LookupError:
        return False
    if proof is None:
        return False
    token = parse_qs(urlsplit(path).query).get("resume", [None])[0]
    return router.is_peer(proof, token, time.time())


def upstream_request(
    router: Router, owner: str, token: str, path: str, headers: Mapping[str, str], peer: str
) -> tuple[str, dict[str, str]]:
    """The owner's URL and the handshake headers for forwarding ``token`` (the client's credentials)."""
    query = f"resume={quote(token, safe='')}"
    api_key = parse_qs(urlsplit(path).query).get("api_key")
    if api_key:
        query += f"&api_key={quote(api_key[0], safe='')}"
    upstream = {name: headers[name] for name in _COPIED_HEADERS if headers.get(name)}
    chain = headers.get("X-Forwarded-For", "").strip()
    upstream["X-Forwarded-For"] = f"{chain}, {peer}" if chain else peer
    upstream[FORWARD_HEADER] = router.peer_proof(token, time.time())
    return f"{owner}{STREAM_PATH}?{query}", upstream


class Forwarder:
    """Relays one remote stream between the client's connection and its owner.

    Args:
        remote: the stream (its resume, slot and progress).
        url: the owner's stream URL, with ``headers`` (:func:`upstream_request`).
        timeout_s: connect, ``hello`` and the answer to the resume, at most.
        send_timeout_s: each send to the owner, at most.
        send: puts a message on the client's connection (bounded, raises when it is gone).
        answered: tells the protocol the owner resumed the stream (False: drop it).
    """

    def __init__(
        self,
        remote: Remote,
        *,
        url: str,
        headers: dict[str, str],
        timeout_s: float,
        send_timeout_s: float,
        send: Sender,
        answered: Callable[[Remote, str], bool],
    ) -> None:
        self.remote = remote
        self._url = url
        self._headers = headers
        self._timeout_s = timeout_s
        self._send_timeout_s = send_timeout_s
        self._send = send
        self._answered = answered
        self._ws: ClientConnection | None = None
        self._settled = asyncio.Event()  # the owner answered, or the forward ended

    async def run(self) -> Outcome:
        """Resume the stream on its owner and relay it until it ends; how it ended.

        Raises:
            ConnectionClosed, SendAborted: the client's connection is gone.
        """
        try:
            try:
                ws, answer = await self._open()
            except (OSError, TimeoutError, InvalidHandshake, InvalidURI, ConnectionClosed, ValueError) as exc:
                reason = f"{type(exc).__name__}: {exc}".replace(self.remote.token, redact(self.remote.token))
                return Unreachable(reason)  # logged: never the whole token
            try:
                return await self._relay(ws, answer)
            finally:
                self._ws = None
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(self._send_timeout_s):
                        await ws.close()
                ws.transport.abort()
        finally:
            self._settled.set()

    async def _open(self) -> tuple[ClientConnection, str]:
        """Connect, take ``hello``, send the resume; the owner's answer (within the timeout)."""
        async with asyncio.timeout(self._timeout_s):
            ws = await connect(
                self._url,
                additional_headers=self._headers,
                compression=None,
                max_size=UPSTREAM_MAX_BYTES,
                max_queue=UPSTREAM_QUEUE,
                open_timeout=None,  # the timeout above bounds the whole exchange
                ping_interval=20,
                ping_timeout=20,
            )
            try:
                hello = json.loads(await ws.recv())
                if not isinstance(hello, dict) or hello.get("type") != "hello":
                    raise ValueError(f"expected hello, got {hello!r:.80}")
                r = self.remote.resume
                await ws.send(wire.encode({"type": "resume", "stream": r.stream, "after_seq": r.after_seq}))
                answer = await ws.recv()
                if not isinstance(answer, str):
                    raise ValueError("a frame before the answer to resume")
            except BaseException:
                ws.transport.abort()
                raise
        return ws, answer

    async def _relay(self, ws: ClientConnection, answer: str) -> Outcome:
        remote = self.remote
        message, data = reslot_message(answer, remote.slot)
        if message.get("type") == "error":
            if message.get("code") == "unknown_stream":
                return Refused(str(message.get("message", "")))
            return PassOn(data)
        if message.get("type") != "resumed" or not isinstance(message.get("id"), str):
            return Unreachable(f"unexpected answer to resume: {answer:.80}")
        name = message["id"]
        if not self._answered(remote, name):
            refusal = wire.ProtocolError(
                "duplicate_id", f"stream id {name!r} is already live", name=name, token=remote.token
            )
            return PassOn(wire.error(refusal))
        self._ws = ws
        self._settled.set()
        await self._send(data)
        progress = remote.progress
        try:
            async for raw in ws:
                if isinstance(raw, bytes):
                    frame, seq = reslot_frame(raw, remote.slot)
                    await self._send(frame)
                    progress.frame(seq)
                    continue
                message, data = reslot_message(raw, remote.slot)
                await self._send(data)
                if message.get("type") == "segment" and "index" in message:
                    progress.mark(int(message["seq"]), int(message["sample"]), int(message["index"]))
                elif message.get("type") == "done":
                    return Finished()
        except ConnectionClosed as exc:
            return Lost(f"the owner's connection closed ({exc})")
        except (ValueError, KeyError, TypeError) as exc:
            return Lost(f"the owner broke the protocol: {exc}")
        # Closed normally before done: the owner closes 1000 when the stream moved elsewhere.
        if ws.close_code == 1000:
            return Finished()
        return Lost(f"the owner closed with {ws.close_code}")

    async def relay(self, data: str) -> bool:
        """Send a client message on to the owner; False: the forward is over (handle it here)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._timeout_s):
                await self._settled.wait()
        ws = self._ws
        if ws is None:
            return False
        # If the owner is gone, the relay loop sees it and regenerates the stream here.
        with contextlib.suppress(ConnectionClosed, SendAborted):
            await send_within(ws.send(data), self._send_timeout_s, lambda reason: ws.transport.abort())
        return True
