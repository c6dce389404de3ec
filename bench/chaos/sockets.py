"""Raw-socket attacks of the chaos soak (:mod:`bench.chaos.attacks`): bytes that no client library sends.

Wyoming events written by hand, HTTP connections that stay silent or dribble, multipart
bodies with parts no form encoder makes. Every connection comes from the hostile source
address, every read has a deadline, and everything opened is closed when the attack ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import time
import wave
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.chaos.target import Tally, Target

READ_S = 5.0
#: Connections each slow-HTTP and idle-Wyoming attack holds at once.
HTTP_CONNECTIONS = 200
WYOMING_CONNECTIONS = 60


async def open_from(t: Target, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection to ``port`` on 127.0.0.1 from the hostile address."""
    return await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, local_addr=(t.source, 0), limit=1 << 20), READ_S
    )


def close(writer: asyncio.StreamWriter) -> None:
    """Drop a connection at once."""
    with contextlib.suppress(Exception):
        writer.transport.abort()


async def wyoming_exchange(t: Target, data: bytes) -> str:
    """Write ``data`` to a new Wyoming connection; the type of the first event back (or why none)."""
    try:
        reader, writer = await open_from(t, t.wyoming_port)
    except (OSError, TimeoutError) as exc:
        return type(exc).__name__
    try:
        writer.write(data)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), READ_S)
        if not line:
            return "closed without an event"
        return str(json.loads(line).get("type"))
    except (OSError, TimeoutError, ValueError) as exc:
        return type(exc).__name__
    finally:
        close(writer)


async def _until_closed(reader: asyncio.StreamReader, deadline: float) -> bool:
    """Read until the server closes the connection (True) or ``deadline`` passes (False)."""
    try:
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            while await reader.read(65536):
                pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True  # reset by the server


async def _hold(
    t: Target,
    port: int,
    deadline: float,
    tally: Tally,
    openers: list[tuple[str, bytes, bytes | None]],
) -> None:
    """Open every (name, first bytes, bytes to dribble once a second) connection and hold it.

    A connection the server closes before ``deadline`` is a probe answered as expected.
    """
    writers: list[asyncio.StreamWriter] = []

    async def one(name: str, first: bytes, dribble: bytes | None) -> None:
        try:
            reader, writer = await open_from(t, port)
        except (OSError, TimeoutError) as exc:
            tally.probe(True, f"{name}: refused ({type(exc).__name__})")  # kept out: also bounded
            return
        writers.append(writer)
        try:
            if first:
                writer.write(first)
            if dribble is None:
                closed = await _until_closed(reader, deadline)
            else:
                closed = False
                while time.monotonic() < deadline and not reader.at_eof():
                    writer.write(dribble)
                    await writer.drain()
                    if await _until_closed(reader, min(deadline, time.monotonic() + 1.0)):
                        closed = True
                        break
            tally.probe(closed, f"{name}: {'closed by the server' if closed else 'held to the end'}")
        except OSError:
            tally.probe(True, f"{name}: reset by the server")

    try:
        async with asyncio.TaskGroup() as group:
            for name, first, dribble in openers:
                group.create_task(one(name, first, dribble))
                await asyncio.sleep(0.002)  # a burst, not one instant
    finally:
        for writer in writers:
            close(writer)


async def hold_http(t: Target, deadline: float, tally: Tally) -> None:
    """Silent connections, headers at a byte a second, endless chunked bodies, short bodies."""
    n = HTTP_CONNECTIONS // 4
    post = f"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {t.key}\r\n".encode()
    chunked = post + b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    short = post + b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n" + b'{"input": '
    openers: list[tuple[str, bytes, bytes | None]] = []
    openers += [("silent", b"", None)] * n
    openers += [("slow headers", b"POST /v1/audio/speech HTTP/1.1\r\n", b"X")] * n
    openers += [("endless chunked body", chunked, b"1\r\n \r\n")] * n
    openers += [("short body", short, None)] * n
    await _hold(t, t.http_port, deadline, tally, openers)


async def hold_wyoming(t: Target, deadline: float, tally: Tally) -> None:
    """Silent Wyoming connections, and ``synthesize-start`` with no stop; a newcomer's ``describe``."""
    n = WYOMING_CONNECTIONS // 2
    start = json.dumps({"type": "synthesize-start", "data": {}}).encode() + b"\n"
    openers: list[tuple[str, bytes, bytes | None]] = [("silent", b"", None)] * n
    openers += [("synthesize-start, no stop", start, None)] * n
    holder = asyncio.create_task(_hold(t, t.wyoming_port, deadline, tally, openers))
    try:
        await asyncio.sleep(1.0)
        while time.monotonic() < deadline - READ_S:  # Home Assistant must still get in
            event = await wyoming_exchange(t, b'{"type": "describe"}\n')
            tally.probe(event == "info", f"newcomer's describe: {event}")
            await asyncio.sleep(1.0)
    finally:
        await holder


def recording() -> bytes:
    """Two seconds of a 180 Hz tone, 16-bit mono WAV at 24 kHz (a valid upload)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24_000)
        frames = bytearray()
        for i in range(48_000):
            value = int(8000 * math.sin(2 * math.pi * 180 * i / 24_000))
            frames += value.to_bytes(2, "little", signed=True)
        w.writeframes(bytes(frames))
    return out.getvalue()


def bad_uploads() -> list[tuple[str, bytes, str]]:
    """Multipart bodies each wrong in one part: (the part the 400 must name, body, boundary)."""
    boundary = "chaosboundary"
    wav = recording()

    def part(name: str, value: bytes, *headers: str, filename: str | None = None) -> bytes:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        head = "\r\n".join([f"Content-Disposition: {disposition}", *headers])
        return f"--{boundary}\r\n{head}\r\n\r\n".encode() + value + b"\r\n"

    audio = part("audio_sample", wav, "Content-Type: audio/wav", filename="me.wav")
    transcript = part("transcript", "这是一段参考录音。".encode(), "Content-Type: text/plain; charset=utf-8")
    end = f"--{boundary}--\r\n".encode()
    odd_charset = part("transcript", b"hello there", "Content-Type: text/plain; charset=x-no-such-charset")
    odd_encoding = part(
        "audio_sample",
        wav,
        "Content-Type: audio/wav",
        "Content-Transfer-Encoding: x-bogus",
        filename="me.wav",
    )
    long_name = part("name", b"n" * 300)
    return [
        ("transcript", audio + odd_charset + end, boundary),
        ("audio_sample", odd_encoding + transcript + end, boundary),
        ("name", audio + transcript + long_name + end, boundary),
    ]
