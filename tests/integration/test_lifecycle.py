"""Cancel, disconnect, many connections and a client that never reads."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest
from websockets.asyncio.client import connect

from server.app import App
from server.text.segments import split_segments
from tests.integration.conftest import fake_engine, wait_until
from tests.wsclient import collect, open_client, recv, recv_json, start, url

LONG_TEXT = "This long sentence keeps the fake engine busy for many blocks in a row. " * 6


async def test_cancel_mid_stream_frees_slot_and_engine_work(make_app: Any) -> None:
    app = await make_app("--fake-step-ms", "10")
    ws, _ = await open_client(app.port)
    await start(ws, id="c", text=LONG_TEXT, seed=1)
    started = await recv_json(ws)
    assert started["type"] == "started" and started["slot"] == 0
    while not isinstance(await recv(ws), bytes):  # wait for audio to flow
        pass
    await ws.send(json.dumps({"type": "cancel", "id": "c"}))
    done = None
    while done is None:
        raw = await recv(ws)
        if isinstance(raw, str) and json.loads(raw)["type"] == "done":
            done = json.loads(raw)
    assert done["reason"] == "cancelled" and done["id"] == "c"
    engine = fake_engine(app)
    await wait_until(lambda: engine.live_sequences == 0)
    assert any(kind == "drop" for kind, _ in engine.events)
    # The slot is free: the next stream gets slot 0 and completes.
    await start(ws, id="c", text="Short one.", seed=2)
    log = (await collect(ws, {"c"}))["c"]
    assert log.started is not None and log.started["slot"] == 0
    assert log.done is not None and log.done["reason"] == "complete"
    await ws.close()


@pytest.mark.parametrize("ttl", ["0", "0.5"])
async def test_disconnect_mid_stream_frees_engine_work_after_the_resume_ttl(make_app: Any, ttl: str) -> None:
    app = await make_app("--fake-step-ms", "60", "--resume-ttl-s", ttl)
    # The warm-up's own sequences (its second phase) must not land among the events counted below.
    async with asyncio.timeout(30):
        await app.warmed_up.wait()
    ws, _ = await open_client(app.port)
    # Long enough (several seconds of steps) that the TTL always expires first.
    await start(ws, id="d", text=LONG_TEXT * 3, seed=1)
    while not isinstance(await recv(ws), bytes):
        pass
    engine = fake_engine(app)
    assert engine.live_sequences > 0
    await ws.close()
    if ttl != "0":
        # Detached, not cancelled: generation goes on while the stream waits for a resume.
        await wait_until(lambda: len(app.connections) == 0)
        assert engine.live_sequences > 0 and app.active_streams == 1
    await wait_until(lambda: engine.live_sequences == 0)
    await wait_until(lambda: app.active_streams == 0)
    # Freed before the text was done: not every segment was generated to its end.
    finished = sum(1 for kind, _ in engine.events if kind == "finish")
    assert finished < len(split_segments(LONG_TEXT * 3))
    # And nothing new starts for it. The inference loop takes commands in order, so once a
    # later stream has completed, nothing queued for the freed one can still be added.
    freed_at = len(engine.events)
    barrier, _ = await open_client(app.port)
    await start(barrier, id="barrier", text="Barrier.", seed=9)
    assert (await collect(barrier, {"barrier"}))["barrier"].done is not None
    await barrier.close()
    assert [kind for kind, _ in list(engine.events)[freed_at:]].count("add") == 1  # the barrier's own


async def test_200_concurrent_connections_complete_without_errors(app: App) -> None:
    async def one(i: int) -> dict[str, Any]:
        ws, _ = await open_client(app.port)
        await start(ws, id=f"s{i}", text=f"Connection {i} says hello. 你好。", seed=i)
        log = (await collect(ws, {f"s{i}"}))[f"s{i}"]
        await ws.close()
        assert not log.errors
        assert log.done is not None
        return log.done

    async with asyncio.timeout(120):
        dones = await asyncio.gather(*(one(i) for i in range(200)))
    assert all(done["reason"] == "complete" for done in dones)
    assert app.active_streams == 0


async def test_client_that_never_reads_is_aborted_and_others_are_unharmed(make_app: Any) -> None:
    app = await make_app(
        "--send-timeout-s", "0.5", "--max-buffered-s", "5", "--fake-step-ms", "1", "--resume-ttl-s", "0"
    )
    # max_queue=1 and a tiny receive buffer: this client stops reading almost at once.
    stalled = await connect(url(app.port), compression=None, max_queue=1, max_size=None)
    await recv(stalled)  # hello
    stalled.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await start(stalled, id="slow", text="x" * 1990, seed=1, format="f32")

    ws, _ = await open_client(app.port)
    await start(ws, id="fine", text=LONG_TEXT, seed=2)
    log = (await collect(ws, {"fine"}))["fine"]
    assert log.done is not None and log.done["reason"] == "complete"
    await ws.close()

    # The server dropped the stalled connection although its client never closed it.
    await wait_until(lambda: len(app.connections) == 0, timeout=30)
    stalled.transport.abort()  # client-side clean-up; its buffered bytes are irrelevant
    # Its sequences are cancelled through the engine's queue and freed at the engine's next
    # block boundary, after the connection is gone: wait (bounded) for that, never sleep.
    await wait_until(lambda: fake_engine(app).live_sequences == 0, timeout=30)
    metrics = app.metrics.render().decode()
    assert 'chattts_errors_total{code="aborted"} 1.0' in metrics
