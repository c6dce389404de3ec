"""A protocol client connection that tracks every stream: frames and messages routed by slot and id.

Checks what the protocol promises for each stream (its ``done`` reason, every seq exactly once,
one last-frame flag) and counts ``started``/``done``/errors into the request's :class:`Outcome`,
across the connections a resumed stream moves through.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from bench.soak.outcome import Outcome

FLAG_LAST = 0x01


@dataclass
class StreamState:
    """One stream as the client saw it, across connections."""

    sid: str
    token: str | None = None
    seqs: Counter[int] = field(default_factory=Counter)
    last_flag_seqs: list[int] = field(default_factory=list)
    done: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)
    attached: bool = False
    frames_here: int = 0  # frames on the current connection

    def contiguous_last(self) -> int:
        """The last seq received with no gap before it (``-1`` for none)."""
        seq = -1
        while seq + 1 in self.seqs:
            seq += 1
        return seq

    def check(self, reasons: tuple[str, ...]) -> str | None:
        """``None`` when the stream ended as expected with every seq exactly once."""
        done = self.done
        if done is None:
            return "no done"
        if done.get("reason") not in reasons:
            return f"done reason {done.get('reason')!r}, expected {'/'.join(reasons)}"
        last = done.get("last_seq")
        dupes = sorted(s for s, c in self.seqs.items() if c != 1)
        if dupes:
            return f"seqs received more than once: {dupes[:5]}"
        if not isinstance(last, int) or set(self.seqs) != set(range(last + 1)):
            missing = sorted(set(range(last + 1)) - set(self.seqs)) if isinstance(last, int) else []
            return f"seqs are not 0..{last}: {len(self.seqs)} received, missing {missing[:5]}"
        if self.last_flag_seqs != [last]:
            return f"last-frame flag on seqs {self.last_flag_seqs[:5]}, expected [{last}]"
        return None


class Conn:
    """One client connection; routes frames and messages to :class:`StreamState` by slot and id."""

    def __init__(self, ws: ClientConnection, outcome: Outcome) -> None:
        self.ws = ws
        self.outcome = outcome
        self.streams: dict[str, StreamState] = {}
        self.slots: dict[int, StreamState] = {}
        self.loose_errors: list[dict[str, Any]] = []
        self.errors_seen = 0

    @classmethod
    async def open(cls, url: str, outcome: Outcome, query: str = "") -> Conn:
        """Connect and read ``hello``."""
        ws = await connect(url + query, compression=None, max_size=None, ping_interval=None, open_timeout=60)
        conn = cls(ws, outcome)
        hello = json.loads(await ws.recv())
        if hello.get("type") != "hello":
            await conn.close()
            raise ValueError(f"expected hello, got {hello!r}")
        return conn

    def track(self, state: StreamState) -> StreamState:
        """Route messages for ``state.sid`` on this connection to ``state``."""
        state.attached = False
        state.frames_here = 0
        self.streams[state.sid] = state
        return state

    async def send(self, message: dict[str, Any] | str | bytes) -> None:
        """Send a JSON object, or a raw text/binary frame."""
        data = json.dumps(message, ensure_ascii=False) if isinstance(message, dict) else message
        await self.ws.send(data)

    async def start(
        self, state: StreamState, text: str | None, fmt: str, seed: int | None, **extra: Any
    ) -> None:
        """Send ``start`` for a tracked stream."""
        self.track(state)
        message: dict[str, Any] = {"type": "start", "id": state.sid, "format": fmt, **extra}
        if text is not None:
            message["text"] = text
        if seed is not None:
            message["seed"] = seed
        await self.send(message)

    async def resume(self, state: StreamState) -> list[str]:
        """Re-attach ``state`` here after its last contiguous seq; the error codes when refused."""
        assert state.token is not None
        self.track(state)
        before = len(self.loose_errors)
        await self.send({"type": "resume", "stream": state.token, "after_seq": state.contiguous_last()})
        await self.until(lambda: state.attached or bool(state.errors) or len(self.loose_errors) > before)
        if state.attached:
            return []
        return state.errors + [str(e.get("code")) for e in self.loose_errors[before:]]

    async def recv_one(self) -> None:
        """Receive one message and apply it to its stream."""
        raw = await self.ws.recv()
        if isinstance(raw, bytes):
            flags, slot = raw[1], int.from_bytes(raw[2:4], "little")
            seq = int.from_bytes(raw[4:8], "little")
            state = self.slots.get(slot)
            if state is None:
                raise ProtocolViolation(f"frame for unknown slot {slot}")
            state.seqs[seq] += 1
            state.frames_here += 1
            self.outcome.frames += 1
            if flags & FLAG_LAST:
                state.last_flag_seqs.append(seq)
            return
        message = json.loads(raw)
        kind = message.get("type")
        state = self.streams.get(message.get("id", ""))
        if kind == "error":
            self.errors_seen += 1
            self.outcome.received_errors.append(str(message.get("code")))
            if state is not None:
                state.errors.append(str(message.get("code")))
            else:
                self.loose_errors.append(message)
            return
        if state is None:
            raise ProtocolViolation(f"message for an unknown stream: {str(message)[:200]}")
        if kind in ("started", "resumed"):
            if kind == "started":
                self.outcome.started += 1
            state.token = message["stream"]
            state.attached = True
            self.slots[int(message["slot"])] = state
        elif kind == "done":
            state.done = message
            self.outcome.done += 1
            self.slots.pop(int(message["slot"]), None)

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Receive until ``predicate()`` holds (checked before each receive)."""
        while not predicate():
            await self.recv_one()

    async def barrier(self) -> None:
        """Wait until the server processed everything sent so far (a ``cancel`` of a bogus id)."""
        probe = f"probe-{secrets.token_hex(4)}"
        before = len(self.loose_errors)
        await self.send({"type": "cancel", "id": probe})

        def answered() -> bool:
            return any(e.get("id") == probe for e in self.loose_errors[before:])

        await self.until(answered)
        for error in self.loose_errors[before:]:
            if error.get("id") == probe:
                self.outcome.received_errors.remove("bad_request")
        self.loose_errors = [e for e in self.loose_errors if e.get("id") != probe]

    def abort(self) -> None:
        """Drop the TCP connection without a close handshake (the network went away)."""
        self.ws.transport.abort()

    async def close(self) -> None:
        """Close (quietly; the connection may already be gone)."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(10):
                await self.ws.close()


class ProtocolViolation(Exception):
    """The server sent something the protocol does not allow here."""


def refused(state: StreamState) -> bool:
    """The stream got an error before it was attached (its ``start`` was refused)."""
    return bool(state.errors) and not state.attached and state.done is None
