"""Every port bounded in time and connections (issue 25: 2, 3), through real sockets.

HTTP: a request head within ``--header-timeout-s`` of the connection's start or of its
previous response (silent connections, headers a byte at a time, idle keep-alive), a body
within ``--body-timeout-s`` (408), at most ``--max-connections`` connections and
``--max-connections-per-client`` per client (503 ``too_many_connections`` at once), and the
fd budget: silent connections that fill the HTTP port's share of the open files leave the
WebSocket port serving. Wyoming: an idle connection, a half-sent event and a streaming
synthesis without its stop each get an ``error`` ``timeout`` and are closed, so silent
connections cannot keep a Home Assistant out.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

from wyoming.audio import AudioChunk, AudioStop
from wyoming.error import Error
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart

from server.frontends.ports import raise_fd_limit
from tests.integration.conftest import MakeApp, wait_until
from tests.integration.test_wyoming import WYOMING, client, read, until_end
from tests.serverproc import free_port, http_status, spawn_server, wait_ready
from tests.wsclient import collect, open_client, start

#: Longer than every deadline these tests set, so a connection still open after it was not cut.
WAIT_S = 10.0
Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@asynccontextmanager
async def connections(port: int, count: int) -> AsyncIterator[list[Streams]]:
    """``count`` TCP connections to ``port`` that send nothing; all closed at the end."""
    opened: list[Streams] = []
    try:
        for _ in range(count):
            async with asyncio.timeout(WAIT_S):
                opened.append(await asyncio.open_connection("127.0.0.1", port))
        yield opened
    finally:
        for _, writer in opened:
            writer.close()


async def closed_within(reader: asyncio.StreamReader, seconds: float = WAIT_S) -> bytes:
    """Everything the server sends until it closes the connection (fails if it does not, in time)."""
    async with asyncio.timeout(seconds):
        return await reader.read()


def http_answer(raw: bytes) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of one whole HTTP response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


# --- HTTP: time -------------------------------------------------------------------------------


async def test_http_silent_connections_and_slow_headers_are_cut_at_the_header_deadline(
    make_app: MakeApp,
) -> None:
    app = await make_app("--header-timeout-s", "0.5")
    assert app.http_port is not None
    async with connections(app.http_port, 1) as [(reader, _)]:
        assert await closed_within(reader) == b""  # closed, nothing sent
    head = b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\r\n"
    async with connections(app.http_port, 1) as [(reader, writer)]:
        cut = asyncio.create_task(closed_within(reader))
        sent = 0
        with suppress(ConnectionError):
            while not cut.done() and sent < len(head):  # one byte every 0.1 s: 7 s for the head
                writer.write(head[sent : sent + 1])
                sent += 1
                await asyncio.sleep(0.1)
        assert await cut == b"" and sent < len(head)


async def test_an_idle_keep_alive_connection_is_closed(make_app: MakeApp) -> None:
    app = await make_app("--header-timeout-s", "0.5")
    assert app.http_port is not None
    async with connections(app.http_port, 1) as [(reader, writer)]:
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(WAIT_S):
            head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"Connection: close" not in head
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        assert await closed_within(reader) == b""


async def test_a_body_that_does_not_arrive_in_time_is_408(make_app: MakeApp) -> None:
    app = await make_app("--body-timeout-s", "0.5", "--header-timeout-s", "30")
    assert app.http_port is not None
    short = b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b'{"input": '
    chunked = b'POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{"in"\r\n'
    upload = (
        b"POST /v1/audio/voices HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n"
        b"Content-Type: multipart/form-data; boundary=b\r\n\r\n--b\r\n"
    )
    for request in (short, chunked, upload):
        async with connections(app.http_port, 1) as [(reader, writer)]:
            writer.write(request)
            status, body = http_answer(await closed_within(reader))
            assert status == 408 and body["error"]["code"] == "timeout", body
            assert "--body-timeout-s" in body["error"]["message"]
    assert 'chattts_errors_total{code="timeout"} 3.0' in app.metrics.render().decode()


# --- HTTP: connections --------------------------------------------------------------------------


async def test_the_http_port_refuses_connections_over_its_caps_with_503(make_app: MakeApp) -> None:
    app = await make_app("--max-connections", "3", "--header-timeout-s", "30")
    assert app.http_port is not None
    async with connections(app.http_port, 3) as held, connections(app.http_port, 1) as [(reader, _)]:
        status, body = http_answer(await closed_within(reader))
        assert status == 503 and body["error"]["code"] == "too_many_connections", body
        assert await asyncio.to_thread(http_status, app.port, "/health") == 200  # another port
        held[0][1].close()
        await wait_until(lambda: app.http is not None and app.http.guard.open == 2)
        assert await asyncio.to_thread(http_status, app.http_port, "/v1/models") == 200


async def test_the_http_port_counts_connections_per_client(make_app: MakeApp) -> None:
    app = await make_app("--max-connections-per-client", "2", "--header-timeout-s", "30")
    assert app.http_port is not None
    async with connections(app.http_port, 2), connections(app.http_port, 1) as [(reader, _)]:
        status, body = http_answer(await closed_within(reader))
        assert status == 503 and body["error"]["code"] == "too_many_connections", body
        assert "this client" in body["error"]["message"]


async def test_silent_http_connections_that_fill_the_fds_leave_the_websocket_port_serving() -> None:
    """The issue's 1010 silent connections against 1024 open files, at half the scale."""
    limit, silent = 512, 500
    port = free_port()

    def low_fd_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    flags = ("--engine", "fake", "--port", str(port), "--header-timeout-s", "60")
    proc = await spawn_server(*flags, env=dict(os.environ), preexec_fn=low_fd_limit)
    try:
        await wait_ready(port, proc)
        opened: list[Streams] = []
        try:
            for _ in range(silent):
                with suppress(TimeoutError, OSError):
                    async with asyncio.timeout(2):
                        opened.append(await asyncio.open_connection("127.0.0.1", port + 1))
            assert await asyncio.to_thread(http_status, port, "/health") == 200
            ws, _ = await open_client(port)
            await start(ws, id="a", text="The WebSocket port still serves.", seed=1)
            assert (await collect(ws, {"a"}))["a"].done is not None
            await ws.close()
            # The HTTP port's last connections were refused, each with its 503.
            status, body = http_answer(await closed_within(opened[-1][0]))
            assert status == 503 and body["error"]["code"] == "too_many_connections"
        finally:
            for _, writer in opened:
                writer.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            await proc.wait()


async def test_the_websocket_port_refuses_tcp_connections_over_its_share_of_the_fds(
    make_app: MakeApp,
) -> None:
    """Connections still in their handshake count too, so they cannot use up another port's fds."""
    limit = raise_fd_limit()  # what the app will see: the soft limit raised to the hard one
    app = await make_app("--http-port", "0", "--fd-reserve", str(limit - 10), "--header-timeout-s", "30")
    guard = app.websocket_guard
    assert guard is not None and (guard.cap, guard.max_lingering) == (8, 2)  # 10 fds: 8 + 2 lingering
    async with connections(app.port, 8), connections(app.port, 1) as [(reader, _)]:
        answer = await closed_within(reader)
        assert answer.startswith(b"HTTP/1.1 503") and answer.endswith(b"too many connections\n"), answer
    await wait_until(lambda: guard.open == 0)
    assert await asyncio.to_thread(http_status, app.port, "/health") == 200


# --- Wyoming ----------------------------------------------------------------------------------


async def wyoming_error(reader: asyncio.StreamReader) -> dict[str, Any]:
    """The data of the ``error`` event the server sends before it closes the connection."""
    raw = await closed_within(reader)
    line, _, rest = raw.partition(b"\n")
    header = json.loads(line)
    assert header["type"] == "error", raw
    data: dict[str, Any] = json.loads(rest[: header["data_length"]])
    return data


async def test_an_idle_or_half_sent_wyoming_connection_gets_a_timeout(make_app: MakeApp) -> None:
    app = await make_app(*WYOMING, "--wyoming-idle-timeout-s", "0.5", "--header-timeout-s", "0.5")
    assert app.wyoming_port is not None
    async with connections(app.wyoming_port, 2) as [(idle, _), (half, writer)]:
        writer.write(b'{"type": "synthesize", "data": {"te')
        for reader, flag in ((idle, "--wyoming-idle-timeout-s"), (half, "--header-timeout-s")):
            error = await wyoming_error(reader)
            assert error["code"] == "timeout" and flag in error["text"], error


async def test_silent_wyoming_connections_cannot_keep_a_client_out(make_app: MakeApp) -> None:
    app = await make_app(*WYOMING, "--max-connections", "3", "--wyoming-idle-timeout-s", "1")
    assert app.wyoming_port is not None
    async with connections(app.wyoming_port, 3) as silent:
        async with client(app) as refused:
            answer = await read(refused)
            assert answer is not None and Error.from_event(answer).code == "too_many_connections"
        for reader, _ in silent:
            assert (await wyoming_error(reader))["code"] == "timeout"
        async with client(app) as c:
            await c.write_event(Synthesize("Now there is room.").event())
            assert AudioStop.is_type((await until_end(c))[-1].type)


async def test_the_idle_clock_stops_while_audio_goes_out_and_runs_again_after(make_app: MakeApp) -> None:
    app = await make_app(*WYOMING, "--wyoming-idle-timeout-s", "0.5", "--fake-step-ms", "50")
    async with client(app) as c:
        began = time.monotonic()
        await c.write_event(Synthesize("A sentence that takes longer than the idle timeout. " * 3).event())
        events = await until_end(c)
        assert AudioStop.is_type(events[-1].type), events[-1]  # no timeout while it was spoken
        assert time.monotonic() - began > 0.5 and any(AudioChunk.is_type(e.type) for e in events)
        after = await read(c)  # then the connection is idle
        assert after is not None and Error.from_event(after).code == "timeout"
        assert await read(c) is None


async def test_a_streaming_synthesis_without_its_stop_is_cut_at_the_text_deadline(make_app: MakeApp) -> None:
    app = await make_app(*WYOMING, "--wyoming-text-timeout-s", "1", "--wyoming-idle-timeout-s", "30")
    c = client(app)
    await c.connect()
    try:
        await c.write_event(SynthesizeStart().event())

        async def keep_writing() -> None:  # a chunk every 0.2 s: the idle clock never runs out
            with suppress(ConnectionError):
                while True:
                    await c.write_event(SynthesizeChunk("More words. ").event())
                    await asyncio.sleep(0.2)

        writing = asyncio.create_task(keep_writing())
        try:
            events = await until_end(c, streaming=True)
        finally:
            writing.cancel()
            await asyncio.gather(writing, return_exceptions=True)
        error = Error.from_event(events[-1])
        assert error.code == "timeout" and "--wyoming-text-timeout-s" in error.text
        assert any(AudioChunk.is_type(e.type) for e in events)  # it was speaking meanwhile
        # Closed: chunks the server never read make its close a reset (the error came first);
        # a write of ours still in flight meets it as a broken pipe instead, on a loaded machine.
        with suppress(ConnectionResetError, BrokenPipeError):
            assert await read(c) is None
    finally:
        with suppress(ConnectionError):
            await c.disconnect()
    await wait_until(lambda: app.active_streams == 0 and len(app.service.registry) == 0)
