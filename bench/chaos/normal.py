"""The chaos soak's normal clients: they stream and check every stream, whatever the attackers do.

Each WebSocket worker keeps one connection (a well-behaved client) and runs one seeded
stream after another from a small pool of requests, reading everything; the HTTP worker
does the same through ``POST /v1/audio/speech``. A stream is *lost* when it does not end
with ``done`` reason ``complete`` (or HTTP 200 and a whole body), and *corrupted* when its
seqs are not 0..last each once with one last-frame flag, or when its audio's SHA-256
differs from the same request's reference (taken before any attack: the fake engine's audio
is a function of the request, and the response cache is off). Time to first audio is from
the ``start`` sent (the request written) to the first audio frame (the first body chunk)
read, stamped with the window it began in.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from websockets.asyncio.client import ClientConnection, connect

#: The requests normal clients make (text, format), each with a fixed seed; short and long.
POOL: tuple[tuple[str, str], ...] = (
    ("Hello, this is a normal client reading its audio.", "pcm16"),
    ("第一句话。第二句话在这里。", "pcm16"),
    ("A longer one: it goes on for a few sentences. Then another. And one more to end it.", "opus"),
    ("Numbers too: 42 apples and 7 pears.", "pcm16"),
    ("普通的客户端也会读完它的音频。然后再开始下一个。", "opus"),
)
FLAG_LAST = 0x01
STREAM_TIMEOUT_S = 60.0


@dataclass
class Record:
    """One normal stream as the client saw it."""

    worker: str
    kind: str  # ws or http
    request: int
    window: int
    phase: str  # quiet, or the attack running when it began
    t_start: float
    ttfa_s: float | None = None
    ok: bool = False
    problem: str | None = None
    corrupted: bool = False


@dataclass
class Normal:
    """The normal clients' shared state: references, records, live tokens, the current window."""

    ws_url: str
    http_url: str
    key: str
    clock: Callable[[], float] = time.perf_counter
    references: dict[tuple[str, int], str] = field(default_factory=dict)  # (kind, request) → sha256
    records: list[Record] = field(default_factory=list)
    #: Tokens of normal streams now running (attack 11 tries to resume them with another key).
    live_tokens: set[str] = field(default_factory=set)
    window: int = 0
    phase: str = "reference"

    @property
    def headers(self) -> dict[str, str]:
        """The normal tenant's key."""
        return {"Authorization": f"Bearer {self.key}"}

    def record(self, record: Record, digest: str | None) -> None:
        """Judge one finished stream against its reference (the first one seen is the reference)."""
        key = (record.kind, record.request)
        if record.ok and digest is not None:
            reference = self.references.setdefault(key, digest)
            if reference != digest:
                record.ok, record.corrupted, record.problem = False, True, "audio differs from the reference"
        self.records.append(record)

    def as_dicts(self) -> list[dict[str, Any]]:
        """Every record, as dicts (for judging)."""
        return [asdict(r) for r in self.records]

    def as_table(self) -> dict[str, Any]:
        """Every record as one row of a table (the JSON stays small over a long run)."""
        columns = [f for f in Record.__dataclass_fields__]
        rows = []
        for record in self.as_dicts():
            for key in ("t_start", "ttfa_s"):
                if record[key] is not None:
                    record[key] = round(record[key], 4)
            rows.append([record[c] for c in columns])
        return {"columns": columns, "rows": rows}


async def ws_worker(normal: Normal, name: str, stop: asyncio.Event, pause_s: float) -> None:
    """One well-behaved WebSocket client: one connection, streams one after another until ``stop``."""
    n = 0
    ws: ClientConnection | None = None
    try:
        while not stop.is_set():
            if ws is None:
                ws = await connect(
                    normal.ws_url, compression=None, max_size=None, additional_headers=normal.headers
                )
                json.loads(await asyncio.wait_for(ws.recv(), STREAM_TIMEOUT_S))  # hello
            request = n % len(POOL)
            record = Record(name, "ws", request, normal.window, normal.phase, normal.clock())
            digest = None
            try:
                digest = await _ws_stream(normal, ws, f"{name}-{n}", request, record)
            except Exception as exc:  # a lost stream: record it, reconnect, go on
                record.problem = f"{type(exc).__name__}: {exc}"[:300]
                await _close(ws)
                ws = None
            normal.record(record, digest)
            n += 1
            await asyncio.sleep(pause_s)
    finally:
        if ws is not None:
            await _close(ws)


async def _ws_stream(normal: Normal, ws: ClientConnection, sid: str, request: int, record: Record) -> str:
    text, fmt = POOL[request]
    seqs: list[int] = []
    last_flags: list[int] = []
    audio = hashlib.sha256()
    token = None
    await ws.send(
        json.dumps({"type": "start", "id": sid, "text": text, "format": fmt, "seed": 1000 + request})
    )
    t0 = normal.clock()
    try:
        async with asyncio.timeout(STREAM_TIMEOUT_S):
            while True:
                raw = await ws.recv()
                if isinstance(raw, bytes):
                    if record.ttfa_s is None:
                        record.ttfa_s = normal.clock() - t0
                    seq = int.from_bytes(raw[4:8], "little")
                    seqs.append(seq)
                    if raw[1] & FLAG_LAST:
                        last_flags.append(seq)
                    audio.update(raw[1:2] + raw[8:])  # flags, sample offset, payload
                    continue
                message = json.loads(raw)
                if message.get("id") != sid:
                    raise RuntimeError(f"a message for another stream: {str(message)[:200]}")
                kind = message["type"]
                if kind == "started":
                    token = message["stream"]
                    normal.live_tokens.add(token)
                elif kind == "error":
                    raise RuntimeError(f"error {message.get('code')}: {message.get('message')}")
                elif kind == "done":
                    break
    finally:
        if token is not None:
            normal.live_tokens.discard(token)
    if message.get("reason") != "complete":
        raise RuntimeError(f"done reason {message.get('reason')}")
    last = message["last_seq"]
    if seqs != list(range(last + 1)) or last_flags != [last]:
        record.corrupted = True
        raise RuntimeError(f"seqs are not 0..{last} once each with one last flag")
    record.ok = True
    return audio.hexdigest()


async def http_worker(normal: Normal, name: str, stop: asyncio.Event, pause_s: float) -> None:
    """One well-behaved OpenAI-endpoint client: one keep-alive session, requests one after another."""
    n = 0
    timeout = aiohttp.ClientTimeout(total=STREAM_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, headers=normal.headers) as session:
        while not stop.is_set():
            request = n % len(POOL)
            record = Record(name, "http", request, normal.window, normal.phase, normal.clock())
            digest = None
            text = POOL[request][0]
            body: dict[str, Any] = {"model": "tts-1", "input": text, "voice": "alloy"}
            body.update(response_format="pcm", seed=2000 + request)
            try:
                t0 = normal.clock()
                async with session.post(f"{normal.http_url}/v1/audio/speech", json=body) as resp:
                    audio = hashlib.sha256()
                    async for chunk in resp.content.iter_any():
                        if record.ttfa_s is None:
                            record.ttfa_s = normal.clock() - t0
                        audio.update(chunk)
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}")
                record.ok = True
                digest = audio.hexdigest()
            except Exception as exc:
                record.problem = f"{type(exc).__name__}: {exc}"[:300]
            normal.record(record, digest)
            n += 1
            await asyncio.sleep(pause_s)


async def _close(ws: ClientConnection) -> None:
    try:
        async with asyncio.timeout(5):
            await ws.close()
    except Exception:
        ws.transport.abort()
