"""A small protocol-v1 test client over a real ``websockets`` connection."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from server.frontends.websocket.wire import FrameHeader, unpack_frame


@dataclass
class Frame:
    header: FrameHeader
    payload: bytes


@dataclass
class StreamLog:
    """Everything one stream received, in arrival order."""

    started: dict[str, Any] | None = None
    segments: list[dict[str, Any]] = field(default_factory=list)
    words: list[dict[str, Any]] = field(default_factory=list)
    frames: list[Frame] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    done: dict[str, Any] | None = None
    order: list[str] = field(default_factory=list)

    @property
    def payload(self) -> bytes:
        return b"".join(f.payload for f in self.frames)


#: Every receive in the tests has a deadline: a message that never comes fails the test.
RECV_TIMEOUT_S = 30.0


async def recv(ws: ClientConnection, timeout: float = RECV_TIMEOUT_S) -> str | bytes:
    """The next message, within ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        return await ws.recv()


def url(port: int) -> str:
    return f"ws://127.0.0.1:{port}/v1/stream"


async def open_client(port: int, **kwargs: Any) -> tuple[ClientConnection, dict[str, Any]]:
    ws = await connect(url(port), compression=None, max_size=None, **kwargs)
    hello = json.loads(await recv(ws))
    assert hello["type"] == "hello"
    return ws, hello


async def recv_json(ws: ClientConnection) -> dict[str, Any]:
    """The next text message (fails on a binary one)."""
    raw = await recv(ws)
    assert isinstance(raw, str), "expected a JSON text message"
    message: dict[str, Any] = json.loads(raw)
    return message


async def collect(
    ws: ClientConnection, ids: set[str], slots: dict[int, str] | None = None
) -> dict[str, StreamLog]:
    """Receive until every stream in ``ids`` got ``done``; frames routed by slot.

    ``slots`` names streams whose ``started`` the caller already consumed.
    """
    logs = {sid: StreamLog() for sid in ids}
    by_slot: dict[int, str] = dict(slots or {})
    pending = set(ids)
    while pending:
        raw = await recv(ws)
        if isinstance(raw, bytes):
            header, payload = unpack_frame(raw)
            log = logs[by_slot[header.slot]]
            log.frames.append(Frame(header, payload))
            log.order.append(f"frame:{header.seq}")
            continue
        msg = json.loads(raw)
        sid = msg.get("id")
        if sid not in logs:
            raise AssertionError(f"unexpected message {msg}")
        log = logs[sid]
        kind = msg["type"]
        log.order.append(f"{kind}:{msg['seq']}" if kind in ("segment", "words") else kind)
        if msg["type"] in ("started", "resumed"):
            log.started = msg
            by_slot[msg["slot"]] = sid
        elif msg["type"] == "segment":
            log.segments.append(msg)
        elif msg["type"] == "words":
            log.words.append(msg)
        elif msg["type"] == "error":
            log.errors.append(msg)
            if "started" not in log.order and "done" not in log.order:  # refused: no done follows
                pending.discard(sid)
        elif msg["type"] == "done":
            log.done = msg
            pending.discard(sid)
    return logs


async def start(ws: ClientConnection, **fields: Any) -> None:
    await ws.send(json.dumps({"type": "start", **fields}))


async def stream_payload(port: int, **fields: Any) -> bytes:
    """The concatenated frame payloads of one complete stream (``start`` fields), the reference."""
    ws, _ = await open_client(port)
    await start(ws, id="ref", **fields)
    log = (await collect(ws, {"ref"}))["ref"]
    await ws.close()
    assert log.done is not None and log.done["reason"] == "complete"
    return log.payload
