"""Graceful drain of a real server process on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal

from tests.serverproc import free_port, http_status, spawn_server, wait_ready
from tests.wsclient import open_client, recv, recv_json, start


async def test_sigterm_drains_running_stream_then_exits_0() -> None:
    port = free_port()
    proc = await spawn_server(
        *("--engine", "fake", "--port", str(port), "--fake-step-ms", "40", "--drain-timeout-s", "60"),
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
