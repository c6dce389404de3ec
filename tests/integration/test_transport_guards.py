"""The transport side of the guards every front end goes through (issue 42: 3, 4, 6, 8), real sockets.

- Read backpressure: a peer that floods pings (or requests) and never reads what they answer
  is not read any more once more than ``MAX_UNSENT_BYTES`` wait unsent for it, so what the
  server buffers for it stays bounded and the flood waits in the sender's socket; a normal
  client meanwhile gets its audio.
- Body deadline: every REST body (OpenAI's, ElevenLabs') is read by one reader, bounded in
  size and in time (``--body-timeout-s``, then 408).
- HTTP/1.0: a streamed response has no chunked encoding; the body ends with the connection.
- A forwarded-resume proof (``X-Chattts-Forwarded``) that is not one is simply not a proof.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from server.app import App
from server.frontends.flow import MAX_UNSENT_BYTES
from server.frontends.websocket.forward import FORWARD_HEADER
from tests.integration.conftest import MakeApp, wait_until
from tests.wsclient import collect, open_client, start

#: Longer than any deadline these tests set: an answer later than this did not come.
WAIT_S = 30.0
#: A flood, in bytes of ping frames (each 131 bytes on the wire, masked, answered by a 127-byte pong).
FLOOD_BYTES = 64 * 1024 * 1024
#: What the server may buffer for the flooding peer: the bound on unsent bytes past which it
#: stops reading, plus the answers to one read (uvloop reads at most 256 KiB at a time).
MAX_BUFFERED = MAX_UNSENT_BYTES + 512 * 1024


def rss_bytes() -> int:
    """This process's resident memory (the server runs in it)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@asynccontextmanager
async def raw_socket(port: int, *, rcvbuf: int = 4096) -> AsyncIterator[socket.socket]:
    """A non-blocking TCP socket to ``port`` with a small receive buffer (it never reads)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(WAIT_S):
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        yield sock
    finally:
        sock.close()


async def upgrade(sock: socket.socket, path: str = "/v1/stream") -> None:
    """The WebSocket handshake on ``sock``; reads exactly the 101 response's head."""
    loop = asyncio.get_running_loop()
    key = base64.b64encode(os.urandom(16)).decode()
    head = (
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    async with asyncio.timeout(WAIT_S):
        await loop.sock_sendall(sock, head.encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            byte = await loop.sock_recv(sock, 1)  # a byte at a time: leave the frames after it unread
            assert byte, f"closed during the handshake: {answer!r}"
            answer += byte
    assert answer.startswith(b"HTTP/1.1 101"), answer


def pings(count: int) -> bytes:
    """``count`` masked ping frames with 125-byte payloads (the most a control frame carries)."""
    frame = b"\x89" + bytes([0x80 | 125]) + b"\x00\x00\x00\x00" + b"p" * 125  # a zero mask
    return frame * count


@dataclass(frozen=True)
class Port:
    """How to flood one front end with requests whose answers are never read."""

    flags: tuple[str, ...]
    port: Callable[[App], int | None]
    path: str | None  # a WebSocket's path (flooded with pings), or None: the batch as it is
    batch: bytes  # about 64 KiB of requests that each get an answer
    transport: Callable[[App], list[Any]]  # the server's transports of the port's connections


def _aiohttp_transports(app: App) -> list[Any]:
    assert app.http is not None and app.http._runner is not None and app.http._runner.server is not None
    return [handler.transport for handler in app.http._runner.server.connections]


PORTS = {
    "websocket": Port(
        (),
        lambda app: app.port,
        "/v1/stream",
        pings(512),
        lambda app: [conn.ws.transport for conn in app.connections],
    ),
    "elevenlabs-websocket": Port(
        (),
        lambda app: app.http_port,
        "/v1/text-to-speech/default/stream-input",
        pings(512),
        _aiohttp_transports,
    ),
    "http": Port(
        (),
        lambda app: app.http_port,
        None,
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n" * 1800,
        _aiohttp_transports,
    ),
    "wyoming": Port(
        ("--wyoming-port", "-1"),
        lambda app: app.wyoming_port,
        None,
        b'{"type": "describe"}\n' * 3000,
        lambda app: [conn._writer.transport for conn in (app.wyoming._connections if app.wyoming else ())],
    ),
}


async def flood(sock: socket.socket, batch: bytes, total: int) -> None:
    """Send ``batch`` until ``total`` bytes are sent (or never: the server stopped reading)."""
    loop = asyncio.get_running_loop()
    sent = 0
    while sent < total:
        await loop.sock_sendall(sock, batch)
        sent += len(batch)


@pytest.mark.parametrize("name", list(PORTS))
async def test_a_flood_whose_answers_are_never_read_is_pushed_back_on_its_sender(
    make_app: MakeApp, name: str
) -> None:
    """Finding 3: once its answers are not read, the server stops reading the peer (every port)."""
    port = PORTS[name]
    app = await make_app(*port.flags)
    number = port.port(app)
    assert number is not None
    before = rss_bytes()
    async with raw_socket(number) as sock:
        if port.path is not None:
            await upgrade(sock, port.path)
        await wait_until(lambda: len(port.transport(app)) == 1)
        [server_side] = port.transport(app)
        sender = asyncio.create_task(flood(sock, port.batch, FLOOD_BYTES))

        def all_read() -> bool:
            return sender.done() and sender.exception() is None

        try:
            # Either the server stops reading this peer, or it reads the whole flood.
            await wait_until(lambda: sender.done() or not server_side.is_reading(), timeout=240)
            assert not all_read(), f"the server read all {FLOOD_BYTES} bytes of a flood it did not answer"
            buffered = server_side.get_write_buffer_size()
            assert buffered < MAX_BUFFERED, (
                f"{buffered} bytes of answers buffered for a peer that never reads"
            )
            assert rss_bytes() - before < 32 * 1024 * 1024
            # The flooding peer costs the others nothing: a normal client gets its audio.
            ws, _ = await open_client(app.port)
            await start(ws, id="a", text="你好。Hello.", format="pcm16")
            log = (await collect(ws, {"a"}))["a"]
            await ws.close()
            assert log.done is not None and log.done["reason"] == "complete" and log.payload
            assert not all_read()  # still held back (or cut by a send deadline)
        finally:
            sender.cancel()
            with suppress(asyncio.CancelledError, OSError):
                await sender


# --- a forwarded-resume proof that cannot be one (finding 8) ------------------------------------

SECRET = "transport-guards-test-secret-0123456789"
NOT_PROOFS = {
    "5000 digits": [(FORWARD_HEADER, "9" * 5000 + ".AAAAAAAAAAAAAAAAAAAAAA")],
    "5000 characters": [(FORWARD_HEADER, "1." + "A" * 5000)],
    "a superscript digit": [(FORWARD_HEADER, "²." + "A" * 22)],
    "twice": [(FORWARD_HEADER, "1.AAAAAAAAAAAAAAAAAAAAAA"), (FORWARD_HEADER, "2.AAAAAAAAAAAAAAAAAAAAAA")],
}


@pytest.mark.parametrize("name", list(NOT_PROOFS))
async def test_a_forwarded_proof_that_cannot_be_one_is_simply_no_proof(
    make_app: MakeApp, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 8: no close 1011, no traceback; during a drain the handshake gets a clear 503."""
    app = await make_app("--resume-secret", SECRET)
    url = f"ws://127.0.0.1:{app.port}/v1/stream?resume=" + "t" * 200
    headers = NOT_PROOFS[name]
    async with asyncio.timeout(WAIT_S):
        ws = await connect(url, additional_headers=headers)
        hello = json.loads(await ws.recv())
        await ws.close()
    assert hello["type"] == "hello"
    app.service.draining = True  # a drain: only another replica's forwarded resume may connect
    with pytest.raises(InvalidStatus) as refused:
        async with asyncio.timeout(WAIT_S):
            await connect(url, additional_headers=headers)
    assert refused.value.response.status_code == 503 and refused.value.response.body == b"draining\n"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


# --- REST bodies: one reader with a deadline (finding 4) ----------------------------------------

SLOW_ROUTES = {
    "openai": ("/v1/audio/speech", "error"),
    "elevenlabs": ("/v1/text-to-speech/default", "detail"),
    "elevenlabs-stream": ("/v1/text-to-speech/default/stream", "detail"),
}


async def http_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response: the status, the headers, the body (to the end of the connection without a length)."""
    async with asyncio.timeout(WAIT_S):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
        if "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        else:
            body = await reader.read()
    return int(lines[0].split()[1]), headers, body


async def closed(reader: asyncio.StreamReader) -> None:
    """The server closes the connection (a reset counts: the client was still sending)."""
    with suppress(ConnectionResetError):
        async with asyncio.timeout(WAIT_S):
            await reader.read()


async def trickle(writer: asyncio.StreamWriter) -> None:
    """A byte of body every 0.1 s, until the server closes the connection."""
    with suppress(ConnectionError):
        while not writer.is_closing():
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(0.1)


async def slow_request(port: int, head: bytes) -> tuple[int, dict[str, Any]]:
    """A request whose body trickles in a byte at a time until the answer comes; that answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        trickling = asyncio.create_task(trickle(writer))
        try:
            status, _, body = await http_response(reader)
        finally:
            trickling.cancel()
            await asyncio.gather(trickling, return_exceptions=True)
        await closed(reader)  # and the connection is closed after it
        return status, json.loads(body)
    finally:
        writer.close()


@pytest.mark.parametrize("route", list(SLOW_ROUTES))
async def test_a_trickled_body_is_cut_at_the_body_deadline_and_frees_the_port(
    make_app: MakeApp, route: str
) -> None:
    """Finding 4: 12 bodies trickled a byte at a time fill a 12-connection port only until the deadline."""
    app = await make_app("--body-timeout-s", "1", "--header-timeout-s", "60", "--max-connections", "12")
    assert app.http_port is not None
    path, shape = SLOW_ROUTES[route]
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    )
    answers = await asyncio.gather(*(slow_request(app.http_port, head.encode()) for _ in range(12)))
    for status, answer in answers:
        assert status == 408, answer
        assert "--body-timeout-s" in answer[shape]["message"], answer
    async with aiohttp.ClientSession() as session:  # the port is free again
        async with session.get(f"http://127.0.0.1:{app.http_port}/v1/models") as response:
            assert response.status == 200
        speech = {"input": "Hello.", "response_format": "pcm"}
        async with session.post(f"http://127.0.0.1:{app.http_port}/v1/audio/speech", json=speech) as response:
            assert response.status == 200 and await response.read()


# --- HTTP/1.0 (finding 6) ---------------------------------------------------------------------

HTTP10_ROUTES = {
    "openai": ("/v1/audio/speech", {"input": "你好。Hello there.", "response_format": "pcm", "seed": 3}),
    "elevenlabs": (
        "/v1/text-to-speech/default?output_format=pcm_24000",
        {"text": "你好。Hello there.", "seed": 3},
    ),
    "elevenlabs-timestamps": (
        "/v1/text-to-speech/default/stream/with-timestamps?output_format=pcm_24000",
        {"text": "你好。Hello there.", "seed": 3},
    ),
}


@pytest.mark.parametrize("route", list(HTTP10_ROUTES))
async def test_an_http_1_0_request_reads_a_whole_body_delimited_by_the_connection(
    make_app: MakeApp, route: str
) -> None:
    """Finding 6: HTTP/1.0 (nginx's upstream default) gets 200 and the whole body, no chunked encoding."""
    app = await make_app("--cache-bytes", "0")
    assert app.http_port is not None
    path, body = HTTP10_ROUTES[route]
    url = f"http://127.0.0.1:{app.http_port}{path}"
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        assert response.status == 200 and response.headers["Transfer-Encoding"] == "chunked"
        expected = await response.read()  # HTTP/1.1, dechunked: the reference
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", app.http_port)
    try:
        writer.write(
            f"POST {path} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        status, headers, got = await http_response(reader)
    finally:
        writer.close()
    assert status == 200, got[:300]
    assert "transfer-encoding" not in headers and "content-length" not in headers, headers
    assert headers["connection"] == "close"
    assert got == expected and got
    # A real HTTP/1.0 client reads the same.
    async with (
        aiohttp.ClientSession(version=aiohttp.HttpVersion10) as session,
        session.post(url, json=body) as response,
    ):
        assert response.status == 200 and await response.read() == expected
