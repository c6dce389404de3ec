"""What every attack of the chaos soak shares: the target server, the tally, bounded replies.

Its own module so that the attack modules (:mod:`bench.chaos.attacks`, :mod:`bench.chaos.guards`,
:mod:`bench.chaos.sockets`) import it and not each other.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from websockets.asyncio.client import ClientConnection, connect

LONG = "This is a long text that its client will never read. " * 36  # under 2000 characters
DEEP = "[" * 20_000 + "]" * 20_000  # 40 KB: inside the size limit, far past any sane depth
REPLY_S = 5.0


@dataclass
class Tally:
    """What an attack did: probes made, probes answered as the issue expects, and notes."""

    probes: int = 0
    expected: int = 0
    notes: Counter[str] = field(default_factory=Counter)

    def probe(self, ok: bool, note: str) -> None:
        """Count one probe and what it got."""
        self.probes += 1
        self.expected += int(ok)
        self.notes[note] += 1


@dataclass(frozen=True)
class Target:
    """The server, the hostile client's identity and what the attacks need to know."""

    ws_port: int
    http_port: int
    wyoming_port: int
    key: str
    source: str
    origin: str
    victim_voice: str
    tokens_file: Path | None

    @property
    def ws_url(self) -> str:
        """The WebSocket endpoint."""
        return f"ws://127.0.0.1:{self.ws_port}/v1/stream"

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible API's base URL."""
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def headers(self) -> dict[str, str]:
        """The hostile tenant's key."""
        return {"Authorization": f"Bearer {self.key}"}

    async def ws(self, **kwargs: Any) -> ClientConnection:
        """A WebSocket connection from the hostile address with the hostile key, past its hello."""
        ws = await connect(
            self.ws_url,
            compression=None,
            max_size=None,
            additional_headers=self.headers,
            local_addr=(self.source, 0),
            open_timeout=REPLY_S,
            **kwargs,
        )
        if kwargs.get("max_queue") != 1:
            await asyncio.wait_for(ws.recv(), REPLY_S)
        return ws

    def session(self) -> aiohttp.ClientSession:
        """An HTTP session from the hostile address."""
        connector = aiohttp.TCPConnector(local_addr=(self.source, 0), limit=64)
        return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=REPLY_S * 2))


async def reply(ws: ClientConnection) -> dict[str, Any]:
    """The next text message within :data:`REPLY_S` (frames skipped)."""
    async with asyncio.timeout(REPLY_S):
        while True:
            raw = await ws.recv()
            if isinstance(raw, str):
                message: dict[str, Any] = json.loads(raw)
                return message


async def quietly_close(ws: ClientConnection) -> None:
    """Close without waiting long (the server may have closed already)."""
    try:
        async with asyncio.timeout(2):
            await ws.close()
    except Exception:
        ws.transport.abort()


def read_tokens(path: Path | None) -> list[str]:
    """The normal streams' tokens the soak published (none when the file is absent)."""
    try:
        return list(json.loads(path.read_text())) if path is not None else []
    except (OSError, ValueError):
        return []


def until(deadline: float) -> bool:
    """Time is left before ``deadline``."""
    return time.monotonic() < deadline
