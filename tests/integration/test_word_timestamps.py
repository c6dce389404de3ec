"""Word timestamps on the WebSocket (``word_timestamps: true``), fake engine: the wire's rules."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

from chattts_stream_client import Client
from server.app import App
from tests.integration.test_resume import read_until_cut
from tests.wsclient import StreamLog, collect, open_client, recv, start

#: Three segments (Latin, Chinese by character, a number spelled out), with tags that are no word.
TEXT = "Hello there, world. 你好世界。We have 3 cats [laugh] today [uv_break] now."
WORDS = ["Hello", "there", "world", "你", "好", "世", "界", "We", "have", "three", "cats", "today", "now"]


def check_words(log: StreamLog, expected: list[str]) -> list[dict[str, Any]]:
    """The rules of ``words`` messages on one complete stream; returns every word in order.

    Every word once, in order; ``start < end``; inside its segment's samples; monotonic across
    segments; each message after its segment's mark and before the frame holding the segment's
    last sample.
    """
    assert log.done is not None and log.done["reason"] == "complete"
    assert len(log.words) == len(log.segments)  # one message per segment
    bounds = [m["sample"] for m in log.segments] + [log.done["samples"]]
    assert [(m["sample"], m["end"]) for m in log.words] == list(itertools.pairwise(bounds))
    spans = {f.header.seq: (f.header.sample, f.header.sample + len(f.payload) // 2) for f in log.frames}
    words: list[dict[str, Any]] = []
    previous_end = 0
    for k, message in enumerate(log.words):
        seg_start, seg_end = bounds[k], bounds[k + 1]
        for word in message["words"]:
            assert seg_start <= word["start"] < word["end"] <= seg_end, (word, seg_start, seg_end)
            assert word["start"] >= previous_end  # monotonic, across segments too
            previous_end = word["end"]
        words += message["words"]
        # Ordering: after its segment's mark, before (or with) the frame of its last sample.
        last_frame = next(seq for seq, (a, b) in spans.items() if a <= seg_end - 1 < b)
        at = log.order.index(f"words:{message['seq']}")
        assert log.order.index(f"segment:{log.segments[k]['seq']}") < at
        assert at < log.order.index(f"frame:{last_frame}")
        assert message["seq"] <= last_frame
    assert [w["text"] for w in words] == expected
    return words


async def run(app: App, **fields: Any) -> StreamLog:
    ws, _ = await open_client(app.port)
    await start(ws, id="w", **fields)
    log = (await collect(ws, {"w"}))["w"]
    await ws.close()
    return log


async def test_every_word_once_in_order_inside_its_segment_before_its_last_frame(app: App) -> None:
    log = await run(app, text=TEXT, seed=4, word_timestamps=True)
    assert [m["text"] for m in log.segments] == [
        "Hello there, world.",
        "你好世界。",
        "We have 3 cats [laugh] today [uv_break] now.",
    ]
    check_words(log, WORDS)


async def test_words_at_another_rate_are_on_that_rate_s_timeline(app: App) -> None:
    log = await run(app, text=TEXT, seed=4, word_timestamps=True, sample_rate=16_000, format="pcm16")
    words = check_words(log, WORDS)
    native = check_words(await run(app, text=TEXT, seed=4, word_timestamps=True), WORDS)
    for slow, fast in zip(words, native, strict=True):  # the same words, scaled to 16 kHz
        assert slow["start"] == fast["start"] * 16_000 // 24_000


async def test_an_incremental_stream_gets_each_segment_s_words_before_more_text_comes(app: App) -> None:
    ws, _ = await open_client(app.port)
    await start(ws, id="w", incremental=True, seed=2, word_timestamps=True)
    await ws.send(json.dumps({"type": "append", "id": "w", "text": "One short sentence. "}))
    # No more text yet: the segment's words and its last frame still come.
    got: list[Any] = []
    async with asyncio.timeout(30):
        while not any(isinstance(m, dict) and m.get("type") == "words" for m in got):
            raw = await recv(ws)
            got.append(raw if isinstance(raw, bytes) else json.loads(raw))
    words = next(m for m in got if isinstance(m, dict) and m.get("type") == "words")
    assert [w["text"] for w in words["words"]] == ["One", "short", "sentence"]
    await ws.send(json.dumps({"type": "end", "id": "w"}))
    await ws.close()


async def test_without_the_flag_no_words_are_sent(app: App) -> None:
    log = await run(app, text=TEXT, seed=4)
    assert log.words == [] and not any(o.startswith("words") for o in log.order)


def without_slot(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k != "slot"} for m in messages]


async def test_a_resume_replays_the_words_with_the_audio(make_app: Any) -> None:
    app = await make_app("--fake-step-ms", "3", "--resume-ttl-s", "30", "--cache-bytes", "0")
    reference = await run(app, text=TEXT, seed=7, word_timestamps=True)
    check_words(reference, WORDS)
    target = next(m for m in reference.words if m["seq"] > 0)
    # Cut the connection right after the frame before a words message, then resume from there.
    ws, _ = await open_client(app.port)
    await start(ws, id="w", text=TEXT, seed=7, word_timestamps=True)
    got: dict[int, bytes] = {}
    token = await read_until_cut(ws, got, cut_after=target["seq"])
    after_seq = max(got)
    assert after_seq == target["seq"] - 1
    ws, _ = await open_client(app.port)
    await ws.send(json.dumps({"type": "resume", "stream": token, "after_seq": after_seq}))
    resumed = (await collect(ws, {"w"}))["w"]
    await ws.close()
    # Every words message after the cut comes again, the same, before the frames it precedes.
    assert without_slot(resumed.words) == without_slot([m for m in reference.words if m["seq"] > after_seq])
    assert resumed.order.index(f"words:{target['seq']}") < resumed.order.index(f"frame:{target['seq']}")


async def test_the_python_client_gives_each_chunk_the_words_timed_before_it(app: App) -> None:
    reference = await run(app, text=TEXT, seed=4, word_timestamps=True)
    async with Client(f"ws://127.0.0.1:{app.port}/v1/stream") as client:
        stream = client.speak(TEXT, seed=4, word_timestamps=True)
        chunks = [chunk async for chunk in stream]
    spans = [(w.text, w.start, w.end) for w in stream.words]
    assert spans == [(w["text"], w["start"], w["end"]) for m in reference.words for w in m["words"]]
    assert [w for c in chunks for w in c.words] == stream.words  # each word once, on a chunk
    for message in reference.words:  # on the chunk the server sent them before
        chunk = next(c for c in chunks if c.seq == message["seq"])
        assert [w.text for w in chunk.words] == [w["text"] for w in message["words"]]


async def test_words_come_before_a_last_frame_that_ends_exactly_with_its_segment(app: App) -> None:
    # 15 characters: 30 fake tokens of 512 samples, exactly 32 frames, so the segment's last
    # frame is complete with its last block (no encoder remainder holds it back).
    log = await run(app, text="Hi, how are ya. And a second one.", seed=1, word_timestamps=True)
    assert log.segments[1]["sample"] == 32 * 480
    check_words(log, ["Hi", "how", "are", "ya", "And", "a", "second", "one"])
