"""Invalid messages are counted per connection (issue #25, finding 10), over real sockets.

A connection that keeps sending messages the server must refuse (bad ``cancel``s, malformed
JSON, unknown streams) is closed with 1008 once it passes ``--invalid-messages-per-s``; a
normal client beside it is served. Rate-limit tokens are spent only on starts that became
streams: a ``start`` refused for ``too_many_streams`` (or any other reason) costs none.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from server.app import App
from tests.wsclient import collect, open_client, recv, start

FLOOD = 2000


async def errors_until_closed(ws: ClientConnection) -> tuple[int, int | None]:
    """Count ``error`` replies until the server closes the connection; (errors, close code)."""
    errors = 0
    try:
        while True:
            message = json.loads(await recv(ws))
            assert message["type"] == "error", message
            errors += 1
    except ConnectionClosed as closed:
        return errors, closed.rcvd.code if closed.rcvd is not None else None


async def flood(ws: ClientConnection, raw: str, count: int) -> None:
    """Send ``raw`` ``count`` times (as fast as the socket takes them; the server may close first)."""
    try:
        for _ in range(count):
            await ws.send(raw)
    except ConnectionClosed:
        pass


@pytest.mark.parametrize(
    "raw",
    [
        '{"type": "cancel", "id": "nobody"}',
        '{"type": "start", "id": ',
        '{"type": "resume", "stream": "not-a-token", "after_seq": 3}',
        '{"type": "start", "id": "x", "text": "hi", "format": "aac"}',
    ],
    ids=["bad cancel", "malformed", "unknown stream", "unsupported"],
)
async def test_a_flood_of_invalid_messages_closes_the_connection_with_1008(make_app: Any, raw: str) -> None:
    app: App = await make_app("--invalid-messages-per-s", "20")
    normal, _ = await open_client(app.port)
    hostile = [(await open_client(app.port))[0] for _ in range(4)]
    floods = [asyncio.create_task(flood(ws, raw, FLOOD)) for ws in hostile]
    try:
        outcomes = await asyncio.gather(*(errors_until_closed(ws) for ws in hostile))
    finally:
        await asyncio.gather(*floods)
    for errors, code in outcomes:
        assert code == 1008, outcomes
        # 20 at once (the bucket is full), plus what trickled back in while they were read.
        assert 20 <= errors <= 40, outcomes
    # The normal client beside them is served, and its own occasional mistake is answered.
    await normal.send('{"type": "cancel", "id": "typo"}')
    assert json.loads(await recv(normal))["code"] == "bad_request"
    await start(normal, id="n", text="Served while others misbehave.", seed=1)
    log = (await collect(normal, {"n"}))["n"]
    assert log.done is not None and log.done["reason"] == "complete"
    await normal.close()


async def test_invalid_messages_are_forgiven_at_their_rate(make_app: Any) -> None:
    """Fewer than the limit per second, however many in all, never close the connection."""
    app: App = await make_app("--invalid-messages-per-s", "200")
    ws, _ = await open_client(app.port)
    for _ in range(6):
        for _ in range(100):  # half the limit, then a pause that refills the bucket
            await ws.send('{"type": "cancel", "id": "nobody"}')
        for _ in range(100):
            assert json.loads(await recv(ws))["code"] == "bad_request"
        await asyncio.sleep(0.5)
    await start(ws, id="ok", text="Still open.", seed=1)
    assert (await collect(ws, {"ok"}))["ok"].done is not None
    await ws.close()


async def test_refused_starts_spend_no_rate_limit_tokens(make_app: Any) -> None:
    app: App = await make_app(
        "--rate-limit-per-min", "1", "--rate-limit-burst", "2", "--max-streams", "1", "--fake-step-ms", "20"
    )
    ws, _ = await open_client(app.port)
    await start(ws, id="a", text="The first stream runs a while. " * 3, seed=1)
    refused = [("b", {"text": "One stream per connection here."}), ("c", {"text": "hi", "format": "aac"})]
    for sid, fields in refused:  # too_many_streams, then unsupported: neither is a stream
        await start(ws, id=sid, **fields)
    logs = await collect(ws, {"a", "b", "c"})
    assert [e["code"] for e in logs["b"].errors] == ["too_many_streams"]
    assert [e["code"] for e in logs["c"].errors] == ["too_many_streams"]
    await start(ws, id="d", text="hi", format="aac")  # room now: unsupported, still no token spent
    assert json.loads(await recv(ws))["code"] == "unsupported"
    # Two tokens in the burst: "a" took one, so "e" gets the second; only then is the client limited.
    await start(ws, id="e", text="The second real stream.", seed=2)
    assert (await collect(ws, {"e"}))["e"].done is not None
    await start(ws, id="f", text="A third real stream.", seed=3)
    assert json.loads(await recv(ws))["code"] == "rate_limited"
    await ws.close()
