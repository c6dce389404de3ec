"""A whole stream over a real WebSocket against the fake engine, checked sample for sample."""

from __future__ import annotations

import numpy as np

from server.app import App
from server.audio.pcm import to_pcm16
from server.engine.fake import expected_audio
from server.engine_api import SequenceRequest, SynthesisParams
from server.frontends.websocket.wire import FLAG_LAST, FLAG_SEGMENT_START
from server.text.segments import split_segments
from tests.wsclient import collect, open_client, start

TEXT = "你好，欢迎使用语音服务。今天天气很好！This is a streaming test. Does it work? 最后一句话。"


def expected_stream(text: str, params: SynthesisParams) -> tuple[list[str], np.ndarray, list[int]]:
    """Segments, the whole stream's float audio, and each segment's first native sample."""
    segments = split_segments(text)
    parts = [
        expected_audio(SequenceRequest(seq_id=0, text=seg, params=params, seed_offset=k))
        for k, seg in enumerate(segments)
    ]
    starts = list(np.cumsum([0] + [len(p) for p in parts])[:-1])
    return segments, np.concatenate(parts), starts


async def test_multisentence_stream_matches_the_fake_engine(app: App) -> None:
    ws, hello = await open_client(app.port)
    assert hello["protocol"] == 1 and "pcm16" in hello["formats"] and hello["sample_rate"] == 24000
    await start(ws, id="s1", text=TEXT, seed=7, voice="default")
    log = (await collect(ws, {"s1"}))["s1"]
    await ws.close()

    segments, audio, starts = expected_stream(TEXT, SynthesisParams(seed=7))
    assert len(segments) == 5
    assert log.order[0] == "started" and log.started is not None
    assert log.started["format"] == "pcm16" and log.started["sample_rate"] == 24000
    assert len(log.started["stream"]) >= 22  # >= 128 bits of base64url

    # One segment message per sentence, each before its first frame, at the exact sample.
    assert [s["text"] for s in log.segments] == segments
    for seg, first_sample in zip(log.segments, starts, strict=True):
        frame = log.frames[seg["seq"]]
        assert seg["sample"] == first_sample
        assert frame.header.sample <= first_sample < frame.header.sample + len(frame.payload) // 2
        assert frame.header.flags & FLAG_SEGMENT_START
        # The segment message comes right before its frame.
        at = log.order.index(f"segment:{seg['seq']}")
        following = next(e for e in log.order[at:] if e.startswith("frame:"))
        assert following == f"frame:{seg['seq']}"
    flagged = [f.header.seq for f in log.frames if f.header.flags & FLAG_SEGMENT_START]
    assert flagged == [s["seq"] for s in log.segments]

    # seq contiguous from 0; sample offsets follow payload lengths; 20 ms frames but the last.
    offset = 0
    for i, frame in enumerate(log.frames):
        assert frame.header.seq == i and frame.header.sample == offset
        offset += len(frame.payload) // 2
        if i < len(log.frames) - 1:  # 20 ms frames except the last
            assert len(frame.payload) == 480 * 2 and not frame.header.flags & FLAG_LAST
    assert log.frames[-1].header.flags & FLAG_LAST

    # PCM equal sample for sample to what the fake engine defines.
    assert log.payload == to_pcm16(audio).tobytes()

    # done totals equal what arrived.
    assert log.done is not None and log.order[-1] == "done"
    assert log.done["reason"] == "complete"
    assert log.done["last_seq"] == len(log.frames) - 1
    assert log.done["samples"] == offset == len(audio)


async def test_f32_stream_is_bit_exact(app: App) -> None:
    ws, _ = await open_client(app.port)
    await start(ws, id="f", text="Hello there. 再见。", seed=3, format="f32")
    log = (await collect(ws, {"f"}))["f"]
    await ws.close()
    _, audio, _ = expected_stream("Hello there. 再见。", SynthesisParams(seed=3))
    assert np.array_equal(np.frombuffer(log.payload, "<f4"), audio)
    assert all(len(f.payload) == 480 * 4 for f in log.frames[:-1])


async def test_several_streams_share_a_connection(app: App) -> None:
    ws, hello = await open_client(app.port)
    ids = {f"s{i}" for i in range(hello["max_streams"])}
    for i, sid in enumerate(sorted(ids)):
        await start(ws, id=sid, text=f"Stream number {i}. 第{i}个。", seed=i)
    logs = await collect(ws, ids)
    await ws.close()
    assert sorted(log.started["slot"] for log in logs.values() if log.started) == list(range(len(ids)))
    for i, sid in enumerate(sorted(ids)):
        _, audio, _ = expected_stream(f"Stream number {i}. 第{i}个。", SynthesisParams(seed=i))
        assert logs[sid].payload == to_pcm16(audio).tobytes()
        assert logs[sid].done is not None and logs[sid].done["reason"] == "complete"
