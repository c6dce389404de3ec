"""Every error of the protocol table that exists at this stage, over a real socket.

After each bad message the same connection must still complete a valid stream.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from server.app import App
from tests.wsclient import collect, open_client, recv, recv_json, start


async def assert_still_serves(ws: ClientConnection, sid: str = "ok") -> None:
    await start(ws, id=sid, text="Still working. 还在工作。", seed=1)
    log = (await collect(ws, {sid}))[sid]
    assert log.done is not None and log.done["reason"] == "complete" and log.frames


BAD_MESSAGES: list[tuple[str, str | bytes, str, str | None]] = [
    ("malformed json", '{"type": "start", "id": ', "bad_request", None),
    ("not an object", '["start"]', "bad_request", None),
    ("a string", '"hello"', "bad_request", None),
    ("unknown type", '{"type": "dance", "id": "x"}', "bad_request", "x"),
    ("missing type", '{"id": "x", "text": "hi"}', "bad_request", "x"),
    ("missing id", '{"type": "start", "text": "hi"}', "bad_request", None),
    ("mistyped id", '{"type": "start", "id": 5, "text": "hi"}', "bad_request", None),
    ("mistyped text", '{"type": "start", "id": "x", "text": 5}', "bad_request", "x"),
    ("missing text", '{"type": "start", "id": "x"}', "bad_request", "x"),
    ("empty text", '{"type": "start", "id": "x", "text": "。。。"}', "bad_request", "x"),
    ("other scripts", '{"type": "start", "id": "x", "text": "Привет. こんにちは。"}', "bad_request", "x"),
    ("speed out of range", '{"type": "start", "id": "x", "text": "hi", "speed": 9}', "bad_request", "x"),
    ("mistyped seed", '{"type": "start", "id": "x", "text": "hi", "seed": "7"}', "bad_request", "x"),
    ("negative top_k", '{"type": "start", "id": "x", "text": "hi", "top_k": -1}', "bad_request", "x"),
    ("binary frame", b"\x01\x02\x03", "bad_request", None),
    ("cancel unknown id", '{"type": "cancel", "id": "nope"}', "bad_request", "nope"),
    ("unknown format", '{"type": "start", "id": "x", "text": "hi", "format": "aac"}', "unsupported", "x"),
    ("unknown rate", '{"type": "start", "id": "x", "text": "hi", "sample_rate": 44100}', "unsupported", "x"),
    ("unknown voice", '{"type": "start", "id": "x", "text": "hi", "voice": "robot"}', "unsupported", "x"),
    ("bad seed voice", '{"type": "start", "id": "x", "text": "hi", "voice": "seed:abc"}', "unsupported", "x"),
]


@pytest.mark.parametrize(("name", "raw", "code", "sid"), BAD_MESSAGES, ids=[m[0] for m in BAD_MESSAGES])
async def test_bad_message_gets_its_code_and_connection_survives(
    app: App, name: str, raw: str | bytes, code: str, sid: str | None
) -> None:
    ws, _ = await open_client(app.port)
    await ws.send(raw)
    err = await recv_json(ws)
    assert err["type"] == "error" and err["code"] == code, err
    assert err["message"] and "Traceback" not in err["message"]
    assert err.get("id") == sid
    await assert_still_serves(ws)
    await ws.close()


async def test_segments_in_scripts_chattts_cannot_speak_are_skipped(app: App) -> None:
    ws, _ = await open_client(app.port)
    await start(ws, id="mixed", text="Hello there. Привет мир. 你好，今天天气很好。", seed=1)
    log = (await collect(ws, {"mixed"}))["mixed"]
    assert log.done is not None and log.done["reason"] == "complete", log.errors
    assert [seg["text"] for seg in log.segments] == ["Hello there.", "你好，今天天气很好。"]
    await ws.close()


async def test_text_too_long(make_app: Any) -> None:
    app = await make_app("--max-text-chars", "50")
    ws, hello = await open_client(app.port)
    assert hello["max_text_chars"] == 50
    await start(ws, id="long", text="a" * 51)
    err = await recv_json(ws)
    assert err["code"] == "text_too_long" and err["id"] == "long"
    await assert_still_serves(ws)
    await ws.close()


async def test_duplicate_id_and_too_many_streams(make_app: Any) -> None:
    app = await make_app("--max-streams", "2", "--fake-step-ms", "20")
    ws, hello = await open_client(app.port)
    assert hello["max_streams"] == 2
    long_text = "This sentence keeps the stream busy for a while. " * 3
    await start(ws, id="a", text=long_text, seed=1)
    await start(ws, id="a", text="again", seed=1)
    await start(ws, id="b", text=long_text, seed=2)
    await start(ws, id="c", text="one too many", seed=3)
    logs = await collect(ws, {"a", "b", "c"})
    assert [e["code"] for e in logs["a"].errors] == ["duplicate_id"]
    assert [e["code"] for e in logs["c"].errors] == ["too_many_streams"]
    assert logs["a"].done and logs["b"].done and logs["a"].done["reason"] == "complete"
    # Slots are free again: the connection takes new streams.
    await assert_still_serves(ws, "c")
    await ws.close()


async def test_message_over_size_limit_closes_with_1009(make_app: Any) -> None:
    app = await make_app("--max-message-bytes", "1024")
    ws, _ = await open_client(app.port)
    await ws.send(json.dumps({"type": "start", "id": "big", "text": "x" * 2000}))
    with pytest.raises(ConnectionClosed) as closed:
        await recv(ws)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    # The server is unharmed: a new connection works.
    ws2, _ = await open_client(app.port)
    await assert_still_serves(ws2)
    await ws2.close()
