"""Frames reach the socket through the pull path (``Stream.deliver``): in order, nothing lost or doubled.

The front end pulls runs of items from the stream and asking for the next run is what marks
the last one sent; so a consumer slower than the engine only makes the outbox hold more, and
what the server counts as sent never runs ahead of what its sender actually handed to the socket.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

from websockets.asyncio.client import connect

from server.frontends.websocket.wire import unpack_frame
from server.streams.stream import Stream
from tests.integration.conftest import wait_until
from tests.wsclient import recv, start, stream_payload, url

TEXT = "A slow listener still hears every frame in order. " * 24


async def test_a_slow_consumer_gets_every_frame_in_order_and_sent_never_runs_ahead(make_app: Any) -> None:
    app = await make_app("--fake-step-ms", "1", "--max-buffered-s", "120", "--send-timeout-s", "30")
    reference = await stream_payload(app.port, text=TEXT, seed=5, format="f32")

    # A reader that holds at most one message and a tiny socket buffer: the server's sends block.
    # (SO_RCVBUF is set before connecting, so the window the client advertises is small too.)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", app.port))
    ws = await connect(url(app.port), sock=sock, compression=None, max_queue=1, max_size=None)
    await recv(ws)  # hello
    await start(ws, id="slow", text=TEXT, seed=5, format="f32")
    started = json.loads(await recv(ws))
    assert started["type"] == "started"
    stream = app.service.registry.get(started["stream"])
    assert isinstance(stream, Stream)

    # The engine is far ahead of the reader: items wait in the outbox, not marked sent (they are
    # marked only when the pump comes back for more, after its socket took the previous run).
    await wait_until(lambda: stream.outbox.ended, timeout=30)
    backlog = stream.outbox.end_index - stream.outbox.sent_index
    assert backlog > 10, backlog

    payload = bytearray()
    seqs: list[int] = []
    samples: list[int] = []
    async with asyncio.timeout(120):
        while True:
            raw = await recv(ws)
            if isinstance(raw, bytes):
                header, data = unpack_frame(raw)
                seqs.append(header.seq)
                samples.append(header.sample)
                payload += data
                await asyncio.sleep(0.001)  # a slow consumer
                continue
            message = json.loads(raw)
            if message["type"] == "done":
                assert message["reason"] == "complete"
                break
    await ws.close()
    assert bytes(payload) == reference
    # Numbered without a gap or a repeat; sample offsets follow each frame's length.
    assert seqs == sorted(set(seqs)) and len(seqs) == seqs[-1] - seqs[0] + 1
    assert samples == sorted(samples)
    await wait_until(lambda: app.active_streams == 0)
