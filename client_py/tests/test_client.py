"""The client against a scripted protocol-v1 server (``websockets`` only, no chattts-stream server).

Runs with the standard library alone: ``python -m unittest discover -s client_py/tests``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import unittest
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

import chattts_stream_client as cs
from chattts_stream_client.errors import error_from
from chattts_stream_client.wire import parse_frame, stream_url

HELLO = {"type": "hello", "protocol": 1, "resume_ttl_s": 5, "formats": ["pcm16"], "max_streams": 4}


def frame(seq: int, payload: bytes, *, last: bool = False, slot: int = 0) -> bytes:
    return struct.pack("<BBHII", 1, 1 if last else 0, slot, seq, seq * len(payload) // 2) + payload


class ScriptedServer:
    """Sends ten frames per stream; drops the first connection after four (no close handshake)."""

    FRAMES = 10

    def __init__(self, drop_after: int | None = 4) -> None:
        self.drop_after = drop_after
        self.resumes: list[dict[str, Any]] = []
        self.connections = 0

    async def handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        first = self.connections == 1
        await ws.send(json.dumps(HELLO))
        with contextlib.suppress(ConnectionClosed):
            await self.converse(ws, first)

    async def converse(self, ws: ServerConnection, first: bool) -> None:
        async for raw in ws:
            msg = json.loads(raw)
            if msg["type"] == "start":
                if msg.get("format") == "nope":
                    refusal = {"type": "error", "id": msg["id"], "code": "unsupported", "message": "x"}
                    await ws.send(json.dumps(refusal))
                    continue
                await ws.send(json.dumps({"type": "started", "id": msg["id"], "slot": 0, "stream": "tok"}))
                await self.play(ws, msg["id"], 0, drop=first and self.drop_after is not None)
            elif msg["type"] == "resume":
                self.resumes.append(msg)
                resumed = {"type": "resumed", "id": "py-s", "slot": 3, "stream": msg["stream"]}
                await ws.send(json.dumps(resumed))
                # Replay a little before after_seq as well: the client must drop the duplicates.
                await self.play(ws, "py-s", max(0, msg["after_seq"] - 1), drop=False, slot=3)

    async def play(self, ws: ServerConnection, sid: str, first: int, *, drop: bool, slot: int = 0) -> None:
        for seq in range(first, self.FRAMES):
            if seq == 2:
                segment = {"type": "segment", "id": sid, "slot": slot, "seq": 2, "sample": 2, "text": "B"}
                await ws.send(json.dumps(segment))
            await ws.send(frame(seq, bytes([seq, seq]), last=seq == self.FRAMES - 1, slot=slot))
            if drop and seq + 1 == self.drop_after:
                await asyncio.sleep(0.05)
                ws.transport.abort()
                return
        done = {"type": "done", "id": sid, "slot": slot, "reason": "complete", "last_seq": 9, "samples": 10}
        await ws.send(json.dumps(done))


class ClientTests(unittest.IsolatedAsyncioTestCase):
    async def serve(self, server: ScriptedServer) -> str:
        self.server = await serve(server.handle, "127.0.0.1", 0)
        self.addAsyncCleanup(self._stop)
        port = next(iter(self.server.sockets)).getsockname()[1]
        return f"ws://127.0.0.1:{port}/v1/stream"

    async def _stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def test_a_dropped_connection_is_resumed_without_gap_or_duplicate(self) -> None:
        script = ScriptedServer()
        async with cs.Client(await self.serve(script), read_timeout=5, max_queued_chunks=2) as client:
            stream = client.speak("Hello.", stream_id="py-s")
            chunks = [chunk async for chunk in stream]
        self.assertEqual([c.seq for c in chunks], list(range(10)))
        self.assertEqual(b"".join(c.data for c in chunks), b"".join(bytes([i, i]) for i in range(10)))
        self.assertEqual(script.connections, 2)
        self.assertEqual(script.resumes[0]["after_seq"], 3)
        self.assertEqual(stream.resumes, 1)
        self.assertGreaterEqual(stream.duplicates, 1)
        self.assertEqual([s.text for s in stream.segments], ["B"])
        self.assertTrue(chunks[-1].last and stream.done is not None and stream.done.samples == 10)

    async def test_refusal_raises_the_typed_exception(self) -> None:
        async with cs.Client(await self.serve(ScriptedServer(None)), read_timeout=5) as client:
            with self.assertRaises(cs.Unsupported):
                await client.synthesize("Hi.", format="nope")
            self.assertEqual(len(await client.synthesize("Hi.")), 20)

    async def test_nothing_waits_forever(self) -> None:
        async def silent(ws: ServerConnection) -> None:
            await ws.send(json.dumps(HELLO))
            await ws.wait_closed()

        self.server = await serve(silent, "127.0.0.1", 0)
        self.addAsyncCleanup(self._stop)
        port = next(iter(self.server.sockets)).getsockname()[1]
        async with cs.Client(f"127.0.0.1:{port}", read_timeout=0.2) as client:
            with self.assertRaises(cs.StreamTimeout):
                await client.synthesize("Hi.")


class WireTests(unittest.TestCase):
    def test_frames_urls_and_errors(self) -> None:
        header, payload = parse_frame(frame(7, b"ab", last=True, slot=2))
        self.assertEqual((header.seq, header.slot, header.last, payload), (7, 2, True, b"ab"))
        with self.assertRaises(cs.ProtocolViolation):
            parse_frame(b"\x02" + bytes(11))
        self.assertEqual(stream_url("http://h:8080"), "ws://h:8080/v1/stream")
        self.assertEqual(stream_url("h:1"), "ws://h:1/v1/stream")
        self.assertEqual(stream_url("wss://h/x/v1/stream?a=1"), "wss://h/x/v1/stream?a=1")
        error = error_from({"code": "overloaded", "message": "busy", "retry_after_ms": 500, "id": "a"})
        self.assertIsInstance(error, cs.Overloaded)
        self.assertEqual((error.retry_after_ms, error.stream_id), (500, "a"))
        self.assertIsInstance(error_from({"code": "future_code"}), cs.ChatTTSStreamError)


if __name__ == "__main__":
    unittest.main()
