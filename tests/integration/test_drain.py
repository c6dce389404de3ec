"""Graceful drain of a real server process on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import pytest
from websockets.asyncio.client import ClientConnection, connect

from tests.serverproc import free_port, http_status, spawn_server, wait_ready
from tests.wsclient import open_client, recv, recv_json, start, url


@pytest.mark.parametrize("form", [(), ("--engine-process",)], ids=["one-process", "engine-process"])
async def test_sigterm_drains_running_stream_then_exits_0(form: tuple[str, ...]) -> None:
    port = free_port()
    proc = await spawn_server(
        *("--engine", "fake", "--port", str(port), "--fake-step-ms", "40", "--drain-timeout-s", "60", *form),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        await wait_ready(port, proc)
        assert await asyncio.to_thread(http_status, port, "/health") == 200
        ws, _ = await open_client(port)
        await start(ws, id="run", text="A stream that is still running when the signal comes. " * 2, seed=4)
        assert (await recv_json(ws))["type"] == "started"
        while not isinstance(await recv(ws), bytes):  # the segment message, then audio
            pass

        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            while await asyncio.to_thread(http_status, port, "/ready") != 503:
                await asyncio.sleep(0.05)

        # New streams on the live connection are refused with shutting_down.
        await start(ws, id="late", text="too late")
        frames, done, refused = 1, None, None
        async with asyncio.timeout(60):
            while done is None:
                raw = await recv(ws)
                if isinstance(raw, bytes):
                    frames += 1
                    continue
                msg = json.loads(raw)
                if msg["type"] == "error":
                    refused = msg
                elif msg["type"] == "done":
                    done = msg
        assert refused is not None and refused["code"] == "shutting_down" and refused["id"] == "late"
        assert done["reason"] == "complete" and done["last_seq"] == frames - 1
        async with asyncio.timeout(30):
            code = await proc.wait()
        assert code == 0
        assert ws.close_code == 1012 or (await _closed_code(ws)) == 1012
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _closed_code(ws: object) -> int | None:
    from websockets.exceptions import ConnectionClosed

    try:
        await recv(ws)  # type: ignore[attr-defined]
    except ConnectionClosed as exc:
        return exc.rcvd.code if exc.rcvd else None
    return None


HANDSHAKE = (
    b"GET /v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


async def test_the_drain_ends_within_its_timeout_whatever_the_clients_do() -> None:
    """Clients that never read nor answer a close, and clients that stopped reading mid-stream.

    Before, each close waited 10 s for its client, one after another: with 4 such clients and
    ``--drain-timeout-s 8`` the process took 40 s to exit, and an idle client got its 1012
    after 30 s. Now idle connections are closed at once, together, each within
    ``--close-timeout-s`` (2 s): one after another, 8 of them would take 16 s. The clients
    that stopped reading are not yet cut by ``--send-timeout-s`` (30 s here): at the drain
    timeout their close cannot even be sent (their buffers are full), and is cut at 2 s.
    """
    drain_s, margin_s = 8.0, 5.0
    port = free_port()
    flags = ("--engine", "fake", "--port", str(port), "--fake-step-ms", "40", "--drain-timeout-s", "8")
    flags += ("--send-timeout-s", "30")
    proc = await spawn_server(*flags, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    silent: list[asyncio.StreamWriter] = []
    stuck: list[ClientConnection] = []
    try:
        await wait_ready(port, proc)
        for _ in range(8):  # the opening handshake, then nothing: never read, never answer a close
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(HANDSHAKE)
            async with asyncio.timeout(10):
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 101")
            silent.append(writer)
        for i in range(2):  # a long stream each, then they stop reading (their buffers fill up)
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # full after a few frames
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            ws = await connect(url(port), compression=None, max_queue=1, sock=sock)
            await ws.send(json.dumps({"type": "start", "id": "s", "text": LONG, "seed": i}))
            stuck.append(ws)
        idle, _ = await open_client(port)
        await asyncio.sleep(0.5)  # the streams' audio fills the stuck clients' buffers

        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert await _closed_code(idle) == 1012
        assert time.monotonic() - signalled < 3.0  # promptly, not after the others' closes
        async with asyncio.timeout(60):
            code = await proc.wait()
        took = time.monotonic() - signalled
        assert code == 0
        assert took <= drain_s + margin_s, f"exited {took:.1f} s after SIGTERM"
    finally:
        for writer in silent:
            writer.close()
        for ws in stuck:
            ws.transport.abort()
            await ws.wait_closed()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


LONG = "A long text that keeps the engine busy for longer than the drain timeout allows. " * 24
