"""A raw protocol client for resume tests: what it took of one stream, and the resume it would send."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from tests.wsclient import recv, url


@dataclass
class Taken:
    """Everything a client took of one stream, each seq once (as a client reassembles it)."""

    start: dict[str, Any]
    token: str | None = None
    seed: int | None = None
    frames: dict[int, bytes] = field(default_factory=dict)  # seq → flags + sample + payload
    marks: dict[int, dict[int, int]] = field(default_factory=dict)  # seq → {segment index: sample}
    done: dict[str, Any] | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)  # every text message, in order

    @property
    def last_seq(self) -> int:
        """The last seq taken with none missing before it."""
        seq = -1
        while seq + 1 in self.frames:
            seq += 1
        return seq

    @property
    def payload(self) -> bytes:
        """The payloads in seq order (the stream's audio bytes)."""
        return b"".join(self.frames[seq][5:] for seq in sorted(self.frames))

    def signature(self) -> tuple[dict[int, bytes], dict[str, Any] | None]:
        """What must equal an unbroken run's: every frame (header fields + payload) and ``done``."""
        done = None if self.done is None else {k: v for k, v in self.done.items() if k != "slot"}
        return dict(self.frames), done

    def resume(self, *, with_request: bool = True) -> dict[str, Any]:
        """The ``resume`` this client sends: after its last seq, with its request, seed and segment."""
        assert self.token is not None
        after = self.last_seq
        message: dict[str, Any] = {"type": "resume", "stream": self.token, "after_seq": after}
        if with_request:
            message["request"] = {**self.start, "seed": self.seed}
            taken = [
                (i, sample)
                for seq in sorted(self.marks)
                if seq <= after
                for i, sample in self.marks[seq].items()
            ]
            if taken:
                message["segment"], message["segment_sample"] = max(taken)
        return message


async def take(
    ws: ClientConnection, taken: Taken, cut_after: int | None = None, *, pause_after: int | None = None
) -> str:
    """Receive one stream into ``taken``; how it stopped.

    "done" after ``done``; "cut" once ``cut_after`` new frames came (the socket is aborted);
    "paused" once ``pause_after`` new frames came (the connection stays); "lost" when the
    connection closed. An ``error`` message fails the test.
    """
    new = 0
    while True:
        try:
            raw = await recv(ws)
        except ConnectionClosed:
            return "lost"
        if isinstance(raw, bytes):
            seq = int.from_bytes(raw[4:8], "little")
            taken.frames.setdefault(seq, raw[1:2] + raw[8:12] + raw[12:])
            new += 1
            if cut_after is not None and new >= cut_after:
                ws.transport.abort()
                return "cut"
            if pause_after is not None and new >= pause_after:
                return "paused"
            continue
        msg = json.loads(raw)
        taken.messages.append(msg)
        kind = msg["type"]
        if kind in ("started", "resumed"):
            taken.token = msg["stream"]
            if kind == "started":
                taken.seed = msg["seed"]
        elif kind == "segment":
            taken.marks.setdefault(msg["seq"], {})[msg["index"]] = msg["sample"]
        elif kind == "done":
            taken.done = msg
            return "done"
        elif kind == "error":
            raise AssertionError(msg)


async def open_ws(port: int, token: str | None = None, api_key: str | None = None) -> ClientConnection:
    """A connection past its ``hello`` (with ``?resume=`` when reconnecting, ``?api_key=`` when given)."""
    params = [f"resume={token}"] * bool(token) + [f"api_key={api_key}"] * bool(api_key)
    query = "?" + "&".join(params) if params else ""
    ws = await connect(url(port) + query, compression=None, max_size=None)
    hello = json.loads(await recv(ws))
    assert hello["type"] == "hello"
    return ws


async def unbroken(port: int, start: dict[str, Any], api_key: str | None = None) -> Taken:
    """One stream, start to done, on one connection (with ``api_key`` when given)."""
    taken = Taken(start)
    ws = await open_ws(port, api_key=api_key)
    await ws.send(json.dumps({"type": "start", **start}))
    assert await take(ws, taken) == "done"
    await ws.close()
    return taken
