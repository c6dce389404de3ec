"""What one stream can make the engine do is bounded by its text (issue 42, finding 7).

Engine work is counted as the fake engine was asked for it: the ``max_tokens`` of every sequence
added (the audio a real model may generate for it, babble included), read from its log.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from server.app import App
from server.engine_api import SEGMENT_BASE_TOKENS, TOKENS_PER_LETTER
from tests.integration.conftest import fake_engine
from tests.wsclient import collect, open_client, recv_json, start

#: The storm: this many (append "a ", flush) pairs.
STORM = 200
STORM_TEXT = "a " * STORM
#: What the docs promise (docs/protocol.md, "Engine work"): merged flushes at most this many times
#: the work of the same text at once, and whatever the timing at most the other.
MERGED_FACTOR = 2
ANY_TIMING_FACTOR = 5


async def warmed(make_app: Any, *flags: str) -> App:
    """A server whose warm-up requests are over, so the engine's log holds only the test's."""
    app: App = await make_app("--cache-bytes", "0", *flags)
    async with asyncio.timeout(30):
        await app.warmed_up.wait()
    return app


def asked_tokens(app: App, since: int = 0) -> tuple[int, int]:
    """Sequences added since the ``since``-th and the tokens they were allowed."""
    added = list(fake_engine(app).added)[since:]
    return len(added), sum(request.max_tokens for request in added)


async def at_once(app: App, text: str) -> tuple[int, int]:
    """The engine work of ``text`` in one ``start``."""
    before = len(fake_engine(app).added)
    ws, _ = await open_client(app.port)
    await start(ws, id="once", text=text, seed=1)
    log = (await collect(ws, {"once"}))["once"]
    await ws.close()
    assert log.done is not None and log.done["reason"] == "complete"
    return asked_tokens(app, before)


async def storm(app: App, delay_ms: int) -> tuple[int, int, list[str]]:
    """The engine work of ``STORM_TEXT`` sent as (append, flush) pairs, then ``end``."""
    before = len(fake_engine(app).added)
    ws, _ = await open_client(app.port)
    await start(ws, id="s", incremental=True, seed=1, max_buffer_delay_ms=delay_ms)
    for _ in range(STORM):
        await ws.send(json.dumps({"type": "append", "id": "s", "text": "a "}))
        await ws.send(json.dumps({"type": "flush", "id": "s"}))
    await ws.send(json.dumps({"type": "end", "id": "s"}))
    log = (await collect(ws, {"s"}))["s"]
    await ws.close()
    assert log.done is not None and log.done["reason"] == "complete", log.errors
    segments, tokens = asked_tokens(app, before)
    return segments, tokens, [s["text"] for s in log.segments]


async def test_a_flush_storm_merges_into_clauses_and_costs_at_most_twice_its_text_at_once(
    make_app: Any,
) -> None:
    app = await warmed(make_app)
    once_segments, once_tokens = await at_once(app, STORM_TEXT)
    # No stall deadline within the test: every flush of "a " is held until a clause is there.
    segments, tokens, texts = await storm(app, delay_ms=60_000)
    assert "".join(texts).replace(" ", "") == "a" * STORM  # all of it spoken, once
    assert all(len(t.replace(" ", "")) >= 16 for t in texts[:-1]), texts  # clause-sized segments
    assert segments <= STORM // 16 + 1, (segments, once_segments)
    assert tokens <= MERGED_FACTOR * once_tokens, (tokens, once_tokens)


async def test_a_flush_storm_costs_at_most_five_times_its_text_whatever_the_timing(make_app: Any) -> None:
    app = await warmed(make_app)
    _, once_tokens = await at_once(app, STORM_TEXT)
    # Held flushes are due at once: how many merge depends on timing, the bound does not.
    _, tokens, texts = await storm(app, delay_ms=0)
    assert "".join(texts).replace(" ", "") == "a" * STORM
    assert tokens <= ANY_TIMING_FACTOR * once_tokens, (tokens, once_tokens)


async def test_a_short_segment_asks_for_tokens_in_proportion_to_its_text(make_app: Any) -> None:
    app = await warmed(make_app)
    segments, tokens = await at_once(app, "Hi.")
    # 1 s of allowance plus 0.25 s a letter, not --segment-max-tokens (2048 tokens: 44 s).
    assert (segments, tokens) == (1, SEGMENT_BASE_TOKENS + 2 * TOKENS_PER_LETTER)
    long_text = "word " * 23 + "end."
    _, long_tokens = await at_once(app, long_text)
    assert long_tokens == SEGMENT_BASE_TOKENS + (4 * 23 + 3) * TOKENS_PER_LETTER


async def test_an_elevenlabs_auto_mode_storm_merges_too(make_app: Any) -> None:
    app = await warmed(make_app, "--max-buffer-delay-ms", "60000")
    _, once_tokens = await at_once(app, STORM_TEXT)
    before = len(fake_engine(app).added)
    url = f"ws://127.0.0.1:{app.http_port}/v1/text-to-speech/default/multi-stream-input?auto_mode=true"
    async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
        await ws.send_json({"text": " ", "context_id": "c"})
        for _ in range(STORM):
            await ws.send_json({"text": "a ", "context_id": "c"})  # auto_mode: each one a flush
        await ws.send_json({"text": "", "context_id": "c", "flush": True})
        await ws.send_json({"context_id": "c", "close_context": True})
        async with asyncio.timeout(60):
            while True:
                message = await ws.receive()
                assert message.type == aiohttp.WSMsgType.TEXT, message
                if json.loads(message.data).get("isFinal") is True:
                    break
    segments, tokens = asked_tokens(app, before)
    assert segments <= STORM // 16 + 1, segments
    assert tokens <= MERGED_FACTOR * once_tokens, (tokens, once_tokens)


async def test_a_flushed_sentence_is_spoken_at_once_and_a_fragment_waits_for_more(make_app: Any) -> None:
    app = await warmed(make_app)
    ws, _ = await open_client(app.port)
    await start(ws, id="y", incremental=True, seed=1, max_buffer_delay_ms=60_000, text="Yes.")
    started = await recv_json(ws)
    assert started["type"] == "started"
    await ws.send(json.dumps({"type": "flush", "id": "y"}))  # a sentence: its latency is kept
    segment = await recv_json(ws)
    assert (segment["type"], segment["text"]) == ("segment", "Yes."), segment
    for word in ("And ", "then ", "some ", "more ", "words."):  # fragments: held, then one segment
        await ws.send(json.dumps({"type": "append", "id": "y", "text": word}))
        await ws.send(json.dumps({"type": "flush", "id": "y"}))
    await ws.send(json.dumps({"type": "end", "id": "y"}))
    log = (await collect(ws, {"y"}, {started["slot"]: "y"}))["y"]
    await ws.close()
    assert log.done is not None and log.done["reason"] == "complete"
    assert [s["text"] for s in log.segments] == ["And then some more words."]
