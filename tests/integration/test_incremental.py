"""Incremental text: speak an LLM's answer while it is still being written (fake engine)."""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any

from websockets.asyncio.client import ClientConnection

from server.app import App
from tests.wsclient import StreamLog, collect, open_client, recv, recv_json, start

ANSWER = "Sentence one is here. 第二句话在这里。The third sentence ends it all."


def llm_tokens(text: str) -> list[str]:
    """Pieces as a language model streams them: Latin words with their space, CJK characters."""
    return re.findall(
        r"[A-Za-z]+[^\sA-Za-z\u4e00-\u9fff]*\s*|[\u4e00-\u9fff][^\sA-Za-z\u4e00-\u9fff]*|\s+", text
    )


async def send(ws: ClientConnection, **fields: Any) -> None:
    await ws.send(json.dumps(fields))


async def test_llm_feed_speaks_sentence_one_early_and_matches_one_shot_audio(app: App) -> None:
    tokens = llm_tokens(ANSWER)
    assert "".join(tokens) == ANSWER
    second_sentence_start = next(i for i, t in enumerate(tokens) if t.startswith("第"))
    ws, _ = await open_client(app.port)
    await start(ws, id="inc", incremental=True, seed=11, max_buffer_delay_ms=5000)
    order: list[str] = []

    async def feed() -> None:
        rng = random.Random(4)
        for i, token in enumerate(tokens):
            await asyncio.sleep(rng.uniform(0.03, 0.1))
            order.append(f"append:{i}")
            await send(ws, type="append", id="inc", text=token)
        await send(ws, type="end", id="inc")

    async def receive() -> StreamLog:
        log = StreamLog()
        while log.done is None:
            raw = await recv(ws)
            if isinstance(raw, bytes):
                if not log.frames:
                    order.append("first_audio")
                from server.frontends.websocket.wire import unpack_frame
                from tests.wsclient import Frame

                header, payload = unpack_frame(raw)
                log.frames.append(Frame(header, payload))
                continue
            msg = json.loads(raw)
            if msg["type"] == "segment":
                log.segments.append(msg)
            elif msg["type"] == "done":
                log.done = msg
            elif msg["type"] == "error":
                raise AssertionError(msg)
        return log

    async with asyncio.timeout(60):
        _, log = await asyncio.gather(feed(), receive())
    await ws.close()
    # First audio of sentence one before the second sentence was even appended.
    assert order.index("first_audio") < order.index(f"append:{second_sentence_start}")
    # One continuous timeline, one done, segments carry each spoken piece.
    assert [f.header.seq for f in log.frames] == list(range(len(log.frames)))
    assert [s["text"] for s in log.segments] == [
        "Sentence one is here.",
        "第二句话在这里。",
        "The third sentence ends it all.",
    ]
    assert log.done is not None and log.done["reason"] == "complete"
    assert log.done["samples"] == sum(len(f.payload) // 2 for f in log.frames)

    # Byte for byte the same as the whole text sent at once with the same seed.
    ws2, _ = await open_client(app.port)
    await start(ws2, id="once", text=ANSWER, seed=11)
    once = (await collect(ws2, {"once"}))["once"]
    await ws2.close()
    assert log.payload == once.payload
    assert [s["sample"] for s in log.segments] == [s["sample"] for s in once.segments]


async def segment_texts_until_done(ws: ClientConnection, sid: str) -> tuple[list[str], dict[str, Any]]:
    log = (await collect(ws, {sid}, slots={0: sid}))[sid]
    assert log.done is not None
    return [s["text"] for s in log.segments], log.done


async def test_stalled_text_is_spoken_after_max_buffer_delay(app: App) -> None:
    ws, _ = await open_client(app.port)
    await start(ws, id="d", incremental=True, seed=1, max_buffer_delay_ms=150)
    assert (await recv_json(ws))["type"] == "started"
    await send(ws, type="append", id="d", text="no sentence end here, but it")
    first = await recv_json(ws)  # nothing else is sent before the stall timer fires
    assert first["type"] == "segment" and first["text"] == "no sentence end here,"
    await send(ws, type="end", id="d")
    texts, done = await segment_texts_until_done(ws, "d")
    assert texts == ["but it"] and done["reason"] == "complete"
    await ws.close()


async def test_flush_speaks_the_buffer_now_and_end_finishes(app: App) -> None:
    ws, _ = await open_client(app.port)
    # A clause's worth (16 letters or more) is spoken at once, whatever the delay.
    text = "Opening words of the answer"
    await start(ws, id="f", incremental=True, seed=1, max_buffer_delay_ms=60000, text=text)
    assert (await recv_json(ws))["type"] == "started"
    await send(ws, type="flush", id="f")
    segment = await recv_json(ws)
    assert segment["type"] == "segment" and segment["text"] == text
    await send(ws, type="append", id="f", text=" and a closing part without a stop")
    await send(ws, type="end", id="f")
    texts, done = await segment_texts_until_done(ws, "f")
    assert texts == ["and a closing part without a stop"] and done["reason"] == "complete"
    await ws.close()


async def test_end_with_nothing_buffered_completes(app: App) -> None:
    ws, _ = await open_client(app.port)
    await start(ws, id="e", incremental=True, seed=1)
    await send(ws, type="append", id="e", text="Just one sentence. ")
    await send(ws, type="end", id="e")
    texts, done = await segment_texts_until_done(ws, "e")
    assert texts == ["Just one sentence."] and done["reason"] == "complete"
    await ws.close()


async def test_cancel_midway(make_app: Any) -> None:
    app = await make_app("--fake-step-ms", "20")
    ws, _ = await open_client(app.port)
    await start(ws, id="c", incremental=True, seed=1)
    await send(ws, type="append", id="c", text="A first sentence that takes a while to speak. And more")
    assert (await recv_json(ws))["type"] == "started"
    while not isinstance(await recv(ws), bytes):
        pass
    await send(ws, type="cancel", id="c")
    done = None
    while done is None:
        raw = await recv(ws)
        if isinstance(raw, str) and json.loads(raw)["type"] == "done":
            done = json.loads(raw)
    assert done["reason"] == "cancelled"
    await send(ws, type="append", id="c", text="too late")
    assert (await recv_json(ws))["code"] == "bad_request"
    await ws.close()


async def test_error_cases(make_app: Any) -> None:
    app = await make_app("--max-text-chars", "60", "--max-pending-chars", "30")
    ws, _ = await open_client(app.port)

    async def expect(code: str, **msg: Any) -> None:
        await send(ws, **msg)
        err = await recv_json(ws)
        assert err["type"] == "error" and err["code"] == code, err

    await expect("bad_request", type="append", id="nobody", text="hi")
    await expect("bad_request", type="flush", id="nobody")
    await expect("bad_request", type="end", id="nobody")
    await expect("bad_request", type="append", id="x")  # no text field
    await start(ws, id="plain", text="A normal stream.", seed=1)
    assert (await recv_json(ws))["type"] == "started"
    await expect("bad_request", type="append", id="plain", text="more")
    await collect(ws, {"plain"}, slots={0: "plain"})

    await start(ws, id="inc", incremental=True, seed=1, max_buffer_delay_ms=60000)
    assert (await recv_json(ws))["type"] == "started"
    await expect("text_too_long", type="append", id="inc", text="x" * 31)  # pending buffer limit
    await send(ws, type="append", id="inc", text="Twenty characters ok. ")
    await expect("text_too_long", type="append", id="inc", text="y" * 45)  # total text limit
    await send(ws, type="end", id="inc")
    await expect("bad_request", type="append", id="inc", text="after end")
    texts, done = await segment_texts_until_done(ws, "inc")
    assert texts == ["Twenty characters ok."] and done["reason"] == "complete"
    await ws.close()
