"""One client that never reads (issue #25, finding 5), over real sockets against the fake engine.

The hostile client connects from 127.0.0.2 (its own identity), the normal one from 127.0.0.1.
The hostile one opens many connections and streams of f32 at 48 kHz (the most bytes per
second of audio) and never reads them. What the server holds for clients stays within
``--memory-budget-bytes`` (the hostile client's streams are freed, its connections aborted),
and the normal client's streams are admitted and complete meanwhile; a hostile client that
fills the queue does not keep a newcomer out, nor in line behind its backlog.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect

from server.app import App
from tests.integration.conftest import wait_until
from tests.wsclient import collect, open_client, start, url

HOSTILE = ("127.0.0.2", 0)
LONG = "This is a long text that nobody will ever read. " * 40  # 2000 characters
BUDGET = 24 * 1024 * 1024
#: Overshoot allowed between a charge that passes the budget and the freeing that follows it
#: (one event-loop turn: at most one batch of engine audio and the frames of one block).
SLACK = 4 * 1024 * 1024


async def hostile_connection(port: int, streams: int) -> ClientConnection:
    """A connection from the hostile address that starts ``streams`` streams and never reads."""
    ws = await connect(url(port), compression=None, max_size=None, max_queue=1, local_addr=HOSTILE)
    for k in range(streams):
        fields = {"type": "start", "id": f"h{k}", "text": LONG, "format": "f32", "sample_rate": 48_000}
        await ws.send(json.dumps(fields))
    return ws


def held(app: App) -> int:
    """Payload bytes the streams hold now (what grew without bound before the budget)."""
    return sum(stream.outbox.held_bytes for stream in app.service.registry.all())


async def normal_streams(port: int, n: int) -> list[dict[str, Any]]:
    """``n`` streams of the normal client, one after the other; their ``done`` messages."""
    done = []
    ws, _ = await open_client(port)
    for k in range(n):
        await start(ws, id=f"n{k}", text="A normal client reads its audio. 第二句。", seed=k, format="pcm16")
        log = (await collect(ws, {f"n{k}"}))[f"n{k}"]
        assert not log.errors and log.done is not None, log.errors
        done.append(log.done)
    await ws.close()
    return done


@pytest.mark.parametrize("send_timeout_s", ["60", "0.3"], ids=["attached", "detached"])
async def test_one_client_that_never_reads_cannot_grow_memory_past_the_budget(
    make_app: Any, send_timeout_s: str
) -> None:
    app: App = await make_app(
        "--memory-budget-bytes",
        str(BUDGET),
        "--fake-step-ms",
        "1",
        "--send-timeout-s",
        send_timeout_s,
        "--max-buffered-s",
        "600",
        "--resume-ttl-s",
        "30",
        "--max-streams",
        "4",
    )
    peak = 0
    stop = asyncio.Event()

    async def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, held(app))
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    hostile = [await hostile_connection(app.port, 4) for _ in range(12)]
    try:
        # 48 streams × 2000 characters of f32 at 48 kHz: about 1.7 GB if all were kept.
        await wait_until(
            lambda: 'chattts_streams_total{reason="budget"}' in app.metrics.render().decode(), 60
        )
        done = await normal_streams(app.port, 5)
        assert all(d["reason"] == "complete" for d in done)
    finally:
        stop.set()
        await watcher
        for ws in hostile:
            ws.transport.abort()
    assert peak <= BUDGET + SLACK, f"held {peak} bytes, budget {BUDGET}"
    assert app.service.budget.total <= BUDGET + SLACK
    for stream in app.service.registry.all():  # what is left waits for a resume: free it too
        stream.close()
    await wait_until(lambda: app.service.budget.total == 0, 10)  # every freed stream gave its bytes back


async def test_a_client_that_fills_the_queue_keeps_no_one_out(make_app: Any) -> None:
    app: App = await make_app(
        "--max-queue", "8", "--max-batch", "2", "--fake-step-ms", "30", "--max-streams", "4"
    )
    hostile = [await hostile_connection(app.port, 4) for _ in range(3)]  # 12 long streams
    try:
        # The hostile client fills the queue: its own next start is refused.
        await wait_until(lambda: app.engine_client.admission.waiting >= 8, 30)
        extra = await hostile_connection(app.port, 1)
        hostile.append(extra)
        refused = json.loads(await asyncio.wait_for(_first_text(extra), 30))
        assert refused["type"] == "error" and refused["code"] == "overloaded", refused
        # A newcomer is admitted and served in the current round, ahead of the backlog.
        [done] = await normal_streams(app.port, 1)
        assert done["reason"] == "complete"
        assert app.engine_client.admission.by_client.get("ip:127.0.0.2", 0) >= 4
    finally:
        for ws in hostile:
            ws.transport.abort()


async def _first_text(ws: ClientConnection) -> str:
    while True:
        message = await ws.recv()
        if isinstance(message, str) and json.loads(message)["type"] != "hello":
            return message
