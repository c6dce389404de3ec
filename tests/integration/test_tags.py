"""Control tags over the real WebSocket and HTTP ports: unknown or malformed ones are refused by name."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from websockets.asyncio.client import ClientConnection

from server.app import App
from server.text.tags import TAG as TAG_RE
from tests.wsclient import collect, open_client, recv_json, start

DEADLINE_S = 30


async def send(ws: ClientConnection, **fields: Any) -> None:
    await ws.send(json.dumps(fields))


async def assert_still_serves(ws: ClientConnection, sid: str) -> None:
    await start(ws, id=sid, text="Still fine [laugh].", seed=1)
    log = (await collect(ws, {sid}))[sid]
    assert log.done is not None and log.done["reason"] == "complete"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("Wait [break_99] here.", "[break_99]"),
        ("你好[foo]。", "[foo]"),
        ("Hello [uv_break there.", "'[uv_break there.'"),
        ("stray ] bracket", "stray ']'"),
        ("[spk_emb] sneaky", "[spk_emb]"),
    ],
)
async def test_start_with_a_bad_tag_is_refused_by_name(app: App, text: str, named: str) -> None:
    async with asyncio.timeout(DEADLINE_S):
        ws, _ = await open_client(app.port)
        await start(ws, id="t", text=text)
        err = await recv_json(ws)
        assert err["type"] == "error" and err["code"] == "bad_request" and err["id"] == "t"
        assert named in err["message"]
        await assert_still_serves(ws, "ok")
        await ws.close()


async def test_tags_are_accepted_and_captions_keep_them(app: App) -> None:
    text = "Hello [uv_break]there [laugh]. 你好[break_3]，再见[lbreak]。"
    async with asyncio.timeout(DEADLINE_S):
        ws, _ = await open_client(app.port)
        await start(ws, id="t", text=text, seed=2)
        log = (await collect(ws, {"t"}))["t"]
        assert log.done is not None and log.done["reason"] == "complete", log.errors
        assert [s["text"] for s in log.segments] == [
            "Hello [uv_break]there [laugh].",
            "你好[break_3]，再见[lbreak]。",
        ]
        await ws.close()


async def test_incremental_tags_may_span_appends_and_bad_ones_are_refused(app: App) -> None:
    async with asyncio.timeout(DEADLINE_S):
        ws, _ = await open_client(app.port)
        await start(ws, id="inc", incremental=True, seed=3, max_buffer_delay_ms=5000)
        assert (await recv_json(ws))["type"] == "started"
        await send(ws, type="append", id="inc", text="One sentence [uv_")
        await send(ws, type="append", id="inc", text="break]done. And [fo")  # refused, not taken
        err = await recv_json(ws)
        assert err["code"] == "bad_request" and err["id"] == "inc" and "'[fo'" in err["message"]
        await send(ws, type="append", id="inc", text="break]done. ")
        await send(ws, type="append", id="inc", text="And [laugh_7] more.")
        err = await recv_json(ws)
        assert err["code"] == "bad_request" and "[laugh_7]" in err["message"]
        await send(ws, type="append", id="inc", text="Then [oral_")
        await send(ws, type="end", id="inc")  # refused: the tag is still open
        err = await recv_json(ws)
        assert err["code"] == "bad_request" and "'[oral_'" in err["message"]
        await send(ws, type="append", id="inc", text="2] the end.")
        await send(ws, type="end", id="inc")
        log = (await collect(ws, {"inc"}, slots={0: "inc"}))["inc"]
        assert log.done is not None and log.done["reason"] == "complete", log.errors
        spoken = [s["text"] for s in log.segments]
        assert spoken == ["One sentence [uv_break]done.", "Then [oral_2] the end."]
        await ws.close()


async def test_openai_endpoint_refuses_an_unknown_tag(app: App) -> None:
    assert app.http.port is not None
    body = {"model": "chattts", "input": "Hi [whisper] there.", "voice": "alloy", "response_format": "pcm"}
    async with (
        asyncio.timeout(DEADLINE_S),
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{app.http.port}/v1/audio/speech", json=body) as resp,
    ):
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["code"] == "bad_request" and "[whisper]" in error["message"]


@pytest.mark.parametrize("text", ["[laugh][laugh]", "[uv_break] [laugh]。[lbreak]", "[break_3]，[oral_2]…"])
async def test_text_of_only_control_tags_is_refused(app: App, text: str) -> None:
    """Issue #25, finding 12: a wordless segment makes the model babble: tags alone are nothing to speak."""
    async with asyncio.timeout(DEADLINE_S):
        ws, _ = await open_client(app.port)
        await start(ws, id="t", text=text)
        err = await recv_json(ws)
        assert err["type"] == "error" and err["code"] == "bad_request" and err["id"] == "t", err
        assert "nothing to speak" in err["message"]
        await assert_still_serves(ws, "ok")
        await ws.close()
        assert app.http.port is not None
        body = {"model": "chattts", "input": text, "voice": "alloy", "response_format": "pcm"}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"http://127.0.0.1:{app.http.port}/v1/audio/speech", json=body) as resp,
        ):
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "bad_request"


async def test_an_incremental_piece_of_only_tags_never_reaches_the_model(app: App) -> None:
    """A tag-only clause between sentences is skipped like punctuation, never given to the model alone."""
    async with asyncio.timeout(DEADLINE_S):
        ws, _ = await open_client(app.port)
        await start(ws, id="inc", incremental=True, seed=3, max_buffer_delay_ms=5000)
        assert (await recv_json(ws))["type"] == "started"
        for piece in ("[laugh][laugh]", ", ", "[uv_break]", "\n", "Real words here.", "\n[lbreak]"):
            await send(ws, type="append", id="inc", text=piece)
        await send(ws, type="end", id="inc")
        log = (await collect(ws, {"inc"}, slots={0: "inc"}))["inc"]
        assert log.done is not None and log.done["reason"] == "complete", log.errors
        spoken = [s["text"] for s in log.segments]
        assert spoken and all(any(c.isalpha() for c in TAG_RE.sub("", s)) for s in spoken), spoken
        await ws.close()
