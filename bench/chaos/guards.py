"""The chaos soak's attacks of issue #42: the guards every front end shares, and the work a text buys.

Each is one of the issue's findings, run from the hostile client's address with its key, in a
bounded loop until its deadline; every wait has a deadline. :mod:`bench.chaos.attacks` numbers
them after its own (:data:`GUARD_ATTACKS`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import aiohttp
from websockets.exceptions import ConnectionClosed

from bench.chaos import sockets
from bench.chaos.target import DEEP, LONG, REPLY_S, Tally, Target, quietly_close, reply, until

#: ElevenLabs' multi-context WebSocket and REST route, with our default voice.
EL_SOCKET = "/v1/text-to-speech/default/multi-stream-input?output_format=pcm_24000"
EL_REST = "/v1/text-to-speech/default/stream?output_format=pcm_24000"
#: An answer the ElevenLabs context can take in one message (under --max-pending-chars).
ANSWER = "This is a long answer that its client will cut off in the middle. " * 12
#: What a client that never reads sends at most before the server must have stopped reading.
FLOOD_BYTES = 16 * 1024 * 1024
#: A write that has not drained in this long: the server stopped reading.
STALLED_S = 3.0


def el_url(t: Target, path: str) -> str:
    """An ElevenLabs route on the HTTP port."""
    return f"ws://127.0.0.1:{t.http_port}{path}" if "stream-input" in path else f"{t.http_url}{path}"


async def el_interrupt(t: Target, deadline: float, tally: Tally) -> None:
    """1: an ElevenLabs context closed mid-turn by its client (pipecat's and LiveKit's interruption)."""
    async with t.session() as session:
        while until(deadline):
            try:
                async with session.ws_connect(el_url(t, EL_SOCKET), headers={"xi-api-key": t.key}) as ws:
                    await ws.send_str(json.dumps({"text": ANSWER, "context_id": "c", "flush": True}))
                    async with asyncio.timeout(REPLY_S):
                        while not json.loads((await ws.receive()).data).get("audio"):
                            pass
                    await ws.close()  # mid-turn: the server must free the context (the soak counts)
                tally.probe(ws.close_code == 1000, f"closed:{ws.close_code}")
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                tally.probe(False, type(exc).__name__)
            await asyncio.sleep(0.1)


def _ws_opening(path: str, key: str) -> bytes:
    return (
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        f"Authorization: Bearer {key}\r\nxi-api-key: {key}\r\n\r\n"
    ).encode()


_MASK = b"\x01\x02\x03\x04"
PING = b"\x89" + bytes([0x80 | 125]) + _MASK + bytes(b ^ _MASK[i % 4] for i, b in enumerate(b"p" * 125))


async def _flood_unread(t: Target, port: int, opening: bytes, unit: bytes, deadline: float) -> str:
    """Send ``unit`` again and again, never reading: ``stalled``, ``closed`` or ``READ ALL`` (bad)."""
    _, writer = await sockets.open_from(t, port)
    try:
        writer.write(opening)
        chunk, sent = unit * max(1, 65536 // len(unit)), 0
        while sent < FLOOD_BYTES and until(deadline):
            try:
                writer.write(chunk)
                async with asyncio.timeout(STALLED_S):
                    await writer.drain()
            except TimeoutError:
                return "stalled"
            except ConnectionError:
                return "closed"
            sent += len(chunk)
        return "READ ALL" if sent >= FLOOD_BYTES else "deadline"
    finally:
        sockets.close(writer)


async def never_read(t: Target, deadline: float, tally: Tally) -> None:
    """3: pings on the WebSocket and ElevenLabs' socket, pipelined HTTP requests, never reading a reply."""
    floods = [
        (t.ws_port, _ws_opening("/v1/stream", t.key), PING, "ws-pings"),
        (t.http_port, _ws_opening(EL_SOCKET, t.key), PING, "elevenlabs-pings"),
        (t.http_port, b"", b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", "http-pipelined"),
    ]
    while until(deadline):
        for port, opening, unit, name in floods:
            try:
                how = await _flood_unread(t, port, opening, unit, deadline)
            except (OSError, TimeoutError) as exc:
                how = type(exc).__name__
            if how != "deadline":
                tally.probe(how in ("stalled", "closed"), f"{name}:{how}")


async def _http10(t: Target, path: str, body: dict[str, object]) -> str:
    raw = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {t.key}\r\nxi-api-key: {t.key}\r\nContent-Length: {len(raw)}\r\n\r\n"
    )
    reader, writer = await sockets.open_from(t, t.http_port)
    try:
        writer.write(head.encode() + raw)
        async with asyncio.timeout(REPLY_S * 4):
            data = await reader.read(-1)
    finally:
        sockets.close(writer)
    status = data.split(b"\r\n", 1)[0].decode("latin-1")
    chunked = b"transfer-encoding: chunked" in data.partition(b"\r\n\r\n")[0].lower()
    return f"{status.split(' ')[1] if ' ' in status else status}{':chunked' if chunked else ''}"


async def http10(t: Target, deadline: float, tally: Tally) -> None:
    """6: HTTP/1.0 POSTs (nginx's default upstream protocol): 200 with a body HTTP/1.0 can read."""
    while until(deadline):
        for path, body in (
            ("/v1/audio/speech", {"input": "An old proxy.", "voice": "alloy", "response_format": "pcm"}),
            (EL_REST, {"text": "An old proxy."}),
        ):
            try:
                got = await _http10(t, path, body)
            except (OSError, TimeoutError) as exc:
                got = type(exc).__name__
            tally.probe(got == "200", f"{path.split('?')[0]}:{got}")
        await asyncio.sleep(0.2)


async def el_rest_slow(t: Target, deadline: float, tally: Tally) -> None:
    """4: ElevenLabs REST bodies at 1 byte per second: cut by the server (408 or closed).

    The body takes a minute to send; the chaos server's ``--body-timeout-s`` is 5 s.
    """
    body = json.dumps({"text": "Slowly, a byte at a time, for a whole minute of waiting."}).encode()
    head = (
        f"POST {EL_REST} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nxi-api-key: {t.key}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()

    async def one() -> None:
        reader, writer = await sockets.open_from(t, t.http_port)
        try:
            writer.write(head)
            for byte in body:
                try:
                    async with asyncio.timeout(1.0):
                        answer = await reader.read(4096)
                except TimeoutError:
                    writer.write(bytes([byte]))
                    continue
                tally.probe(not answer or b" 408 " in answer[:16], f"cut:{answer[:12]!r}")
                return
            tally.probe(False, "never cut")
        except ConnectionError:
            tally.probe(True, "reset")
        finally:
            sockets.close(writer)

    while until(deadline):
        await asyncio.gather(*(one() for _ in range(12)), return_exceptions=True)


async def el_invalid(t: Target, deadline: float, tally: Tally) -> None:
    """9: ElevenLabs' WebSocket flooded with invalid messages: closed with 1008 as /v1/stream."""
    async with t.session() as session:
        while until(deadline):
            try:
                async with session.ws_connect(el_url(t, EL_SOCKET), headers={"xi-api-key": t.key}) as ws:
                    for _ in range(3000):
                        if ws.closed:
                            break
                        await ws.send_str("{not json")
                    async with asyncio.timeout(REPLY_S):
                        async for _ in ws:
                            pass
                tally.probe(ws.close_code == 1008, f"closed:{ws.close_code}")
            except (aiohttp.ClientError, ConnectionError, TimeoutError) as exc:
                tally.probe(False, type(exc).__name__)
            await asyncio.sleep(0.2)


async def el_numbers(t: Target, deadline: float, tally: Tally) -> None:
    """5: ElevenLabs input: JSON 20 000 deep, speed 1e400, ``?seed=²``, 5000-digit query numbers: 400."""
    bodies = [
        '{"text": "Hi.", "voice_settings": {"speed": 1e400}}',
        '{"text": "Hi.", "voice_settings": ' + DEEP + "}",
        '{"text": "Hi.", "voice_settings": "fast"}',
    ]
    queries = ["&seed=%C2%B2", "&seed=" + "9" * 5000, "&optimize_streaming_latency=" + "9" * 5000]
    headers = {"xi-api-key": t.key, "Content-Type": "application/json"}
    async with t.session() as session:
        while until(deadline):
            for body in bodies:
                try:
                    async with session.post(el_url(t, EL_REST), data=body, headers=headers) as resp:
                        tally.probe(resp.status == 400, f"rest:{resp.status}")
                except (aiohttp.ClientError, TimeoutError) as exc:
                    tally.probe(False, f"rest:{type(exc).__name__}")
            for query in queries:
                try:
                    async with session.post(el_url(t, EL_REST + query), data=bodies[0], headers=headers) as r:
                        tally.probe(r.status == 400, f"query:{r.status}")
                except (aiohttp.ClientError, TimeoutError) as exc:
                    tally.probe(False, f"query:{type(exc).__name__}")
            await asyncio.sleep(0.2)


async def flush_storm(t: Target, deadline: float, tally: Tally) -> None:
    """7: 400 × (append "a", flush) on one incremental stream: at most a few times the audio of its text."""
    while until(deadline):
        try:
            ws = await t.ws()
            await ws.send(json.dumps({"type": "start", "id": "f", "incremental": True, "format": "pcm16"}))
            await reply(ws)  # started
            for _ in range(400):
                await ws.send('{"type": "append", "id": "f", "text": "a "}')
                await ws.send('{"type": "flush", "id": "f"}')
            await ws.send('{"type": "end", "id": "f"}')
            samples, done = 0, None
            async with asyncio.timeout(REPLY_S * 24):
                while done is None:
                    raw = await ws.recv()
                    if isinstance(raw, bytes):
                        samples += (len(raw) - 12) // 2
                    elif json.loads(raw)["type"] in ("done", "error"):
                        done = json.loads(raw)
            seconds = samples / 24_000
            # 400 one-letter words said at once last about 2 minutes; hours were the finding.
            tally.probe(done.get("type") == "done" and seconds < 240, f"audio:{seconds // 30 * 30:.0f}s+")
            await quietly_close(ws)
        except (ConnectionClosed, OSError, TimeoutError) as exc:
            tally.probe(False, type(exc).__name__)


async def churn(t: Target, deadline: float, tally: Tally) -> None:
    """2: start and cancel streams in every format at 48 kHz, as fast as the server answers."""
    formats = ["pcm16", "f32", "opus", "ogg", "mp3", "flac", "mulaw"]
    while until(deadline):
        try:
            ws = await t.ws()
            for n, fmt in enumerate(formats * 4):
                rate = 8000 if fmt == "mulaw" else 48_000
                start = {"type": "start", "id": f"c{n}", "text": LONG, "format": fmt, "sample_rate": rate}
                await ws.send(json.dumps(start))
                answer = await reply(ws)
                await ws.send(json.dumps({"type": "cancel", "id": f"c{n}"}))
                while answer["type"] not in ("done", "error"):
                    answer = await reply(ws)
                tally.probe(answer.get("reason") == "cancelled", f"{answer['type']}:{answer.get('reason')}")
            await quietly_close(ws)
        except (ConnectionClosed, OSError, TimeoutError) as exc:
            tally.probe(False, type(exc).__name__)


async def long_number(t: Target, deadline: float, tally: Tally) -> None:
    """10: a number hundreds of digits long: refused at ``start`` or spoken, never an ``engine_error``."""
    while until(deadline):
        try:
            ws = await t.ws()
            await ws.send(json.dumps({"type": "start", "id": "n", "text": "7" * 600 + "."}))
            answer = await reply(ws)
            while answer["type"] not in ("done", "error"):
                answer = await reply(ws)
            ok = answer.get("code") == "bad_request" or answer.get("reason") == "complete"
            tally.probe(ok, f"{answer['type']}:{answer.get('code') or answer.get('reason')}")
            await quietly_close(ws)
        except (ConnectionClosed, OSError, TimeoutError) as exc:
            tally.probe(False, type(exc).__name__)
        await asyncio.sleep(0.2)


Attack = Callable[[Target, float, Tally], Awaitable[None]]
#: Issue #42's attacks, by name (chaos_attacks numbers them after its own).
GUARD_ATTACKS: list[tuple[str, Attack]] = [
    ("el_interrupt", el_interrupt),
    ("never_read", never_read),
    ("http10", http10),
    ("el_rest_slow", el_rest_slow),
    ("el_invalid", el_invalid),
    ("el_numbers", el_numbers),
    ("flush_storm", flush_storm),
    ("churn", churn),
    ("long_number", long_number),
]
