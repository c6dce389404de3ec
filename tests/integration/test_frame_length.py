"""``start.frame_ms``: longer frames over real sockets, the same audio, the same resume rules.

A stream that asks for 40 or 60 ms frames gets the same PCM bytes as one with 20 ms frames,
cut into fewer, longer frames: the sample offsets, ``segment`` messages and ``done`` agree.
A resume mid-stream with 60 ms frames rebuilds the unbroken stream byte for byte. A bad value
is refused with an error naming the field and the choices; the connection stays open.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import opuslib
import pytest
from websockets.asyncio.client import connect

from server.app import App
from tests.integration.test_resume import contiguous_last, read_until_cut
from tests.wsclient import StreamLog, collect, open_client, recv, recv_json, start, url

TEXT = "First sentence of the story. 第二句话在这里。And the third one ends it."
FLAGS = ("--fake-step-ms", "3", "--resume-ttl-s", "30")


async def one_stream(port: int, **fields: Any) -> StreamLog:
    ws, _ = await open_client(port)
    await start(ws, id="s", text=TEXT, seed=7, **fields)
    log = (await collect(ws, {"s"}))["s"]
    await ws.close()
    assert log.done is not None and log.done["reason"] == "complete", log.errors
    return log


@pytest.mark.parametrize("fmt", ["pcm16", "f32", "mulaw"])
@pytest.mark.parametrize("frame_ms", [40, 60])
async def test_longer_frames_carry_the_same_bytes_on_the_same_timeline(
    make_app: Any, fmt: str, frame_ms: int
) -> None:
    app = await make_app(*FLAGS)
    short = await one_stream(app.port, format=fmt)
    long = await one_stream(app.port, format=fmt, frame_ms=frame_ms)
    assert short.started is not None and short.started["frame_ms"] == 20
    assert long.started is not None and long.started["frame_ms"] == frame_ms
    assert long.payload == short.payload
    width = {"pcm16": 2, "f32": 4, "mulaw": 1}[fmt]
    samples = 24_000 * frame_ms // 1000
    # Every frame but the last is exactly frame_ms long, and each sample offset follows on.
    assert all(len(f.payload) == samples * width for f in long.frames[:-1])
    offsets = [f.header.sample for f in long.frames]
    assert offsets == [i * samples for i in range(len(long.frames))]
    assert [f.header.seq for f in long.frames] == list(range(len(long.frames)))
    assert len(long.frames) < len(short.frames)
    assert long.done is not None and short.done is not None
    assert long.done["samples"] == short.done["samples"]
    assert long.done["last_seq"] == len(long.frames) - 1
    # Segments start at the same samples, each in the longer frame that holds it.
    assert [m["sample"] for m in long.segments] == [m["sample"] for m in short.segments]
    assert [m["seq"] for m in long.segments] == [m["sample"] // samples for m in long.segments]
    marked = {f.header.seq for f in long.frames if f.header.segment_start}
    assert marked == {m["seq"] for m in long.segments}


async def test_opus_in_60_ms_packets_decodes_to_the_stream_length(make_app: Any) -> None:
    app = await make_app(*FLAGS)
    log = await one_stream(app.port, format="opus", frame_ms=60)
    assert log.started is not None and log.started["frame_ms"] == 60
    decoder = opuslib.Decoder(24_000, 1)
    decoded = [np.frombuffer(decoder.decode(f.payload, 2880), "<i2") for f in log.frames]
    assert all(len(d) == 1440 for d in decoded)  # every packet is one 60 ms Opus frame
    total = sum(len(d) for d in decoded) - log.started["preskip"]
    assert log.done is not None
    assert total >= log.done["samples"] > total - 1440  # the last packet's padding is trimmed
    assert sum(f.header.sample == 0 for f in log.frames) == 1
    assert log.done["samples"] == (await one_stream(app.port, format="pcm16")).done["samples"]  # type: ignore[index]


@pytest.mark.parametrize("fmt", ["pcm16", "opus"])
@pytest.mark.parametrize("cut", [1, 3, 7])
async def test_a_resume_mid_stream_with_60_ms_frames_rebuilds_the_unbroken_stream(
    make_app: Any, fmt: str, cut: int
) -> None:
    app = await make_app(*FLAGS)
    ws, _ = await open_client(app.port)
    await start(ws, id="s", text=TEXT, seed=11, format=fmt, frame_ms=60)
    expected: dict[int, bytes] = {}
    await read_until_cut(ws, expected, None)
    got: dict[int, bytes] = {}
    ws, _ = await open_client(app.port)
    await start(ws, id="s", text=TEXT, seed=11, format=fmt, frame_ms=60)
    token = await read_until_cut(ws, got, cut)
    assert token is not None and -1 not in got
    ws = await connect(url(app.port), compression=None, max_size=None)
    assert json.loads(await recv(ws))["type"] == "hello"
    after = contiguous_last(got)
    assert after == cut - 1
    await ws.send(json.dumps({"type": "resume", "stream": token, "after_seq": after}))
    await read_until_cut(ws, got, None)
    assert got == expected
    # The frames are 60 ms: seq n starts at sample n * 1440 (after Opus's first, shorter one).
    header_samples = {seq: int.from_bytes(raw[1:5], "little") for seq, raw in got.items() if seq >= 0}
    first = 1440 if fmt == "pcm16" else 1440 - 156
    assert all(header_samples[n] == max(0, n * 1440 - (1440 - first)) for n in header_samples)


@pytest.mark.parametrize(
    ("fields", "code", "says"),
    [
        ({"frame_ms": 30}, "bad_request", "frame_ms is one of 20, 40, 60"),
        ({"frame_ms": 120}, "bad_request", "frame_ms is one of 20, 40, 60"),
        ({"frame_ms": "60"}, "bad_request", "$.frame_ms"),
        ({"frame_ms": 60, "format": "ogg"}, "unsupported", "frame_ms applies to"),
        ({"frame_ms": 40, "format": "mp3"}, "unsupported", "frame_ms applies to"),
    ],
)
async def test_a_bad_frame_ms_is_refused_naming_it_and_the_connection_stays(
    app: App, fields: dict[str, Any], code: str, says: str
) -> None:
    ws, _ = await open_client(app.port)
    await start(ws, id="bad", text="Hello there.", **fields)
    error = await recv_json(ws)
    assert error["type"] == "error" and error["code"] == code and error["id"] == "bad"
    assert says in error["message"], error["message"]
    # The connection is still good: the same id now starts with a valid frame length.
    await start(ws, id="bad", text="Hello there.", frame_ms=40)
    log = (await collect(ws, {"bad"}))["bad"]
    assert log.started is not None and log.started["frame_ms"] == 40
    assert log.done is not None and log.done["reason"] == "complete"
    await ws.close()


async def test_a_resume_request_with_a_bad_frame_ms_is_refused(make_app: Any) -> None:
    """The ``request`` a resume carries is checked like a ``start``: a bad frame_ms is refused."""
    app = await make_app(*FLAGS)
    ws, _ = await open_client(app.port)
    request = {"type": "start", "id": "s", "text": TEXT, "seed": 1, "frame_ms": 50}
    await ws.send(json.dumps({"type": "resume", "stream": "x" * 32, "after_seq": 3, "request": request}))
    error = await recv_json(ws)
    assert error["code"] == "bad_request" and "frame_ms is one of 20, 40, 60" in error["message"]
    await ws.close()


async def test_a_client_that_stops_reading_is_cut_by_the_send_timeout_alone(
    make_app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A run's sends share one deadline, pushed on as they progress: a send that waits is still cut.

    ``--max-buffered-s`` and the memory budget are out of reach here, so only the send
    deadline can end the connection.
    """
    flags = ("--fake-step-ms", "1", "--send-timeout-s", "0.5", "--max-buffered-s", "3600")
    app = await make_app(*flags, "--replay-max-s", "3600", "--resume-ttl-s", "0")
    # max_queue=1: the client library stops reading its socket once one message waits unread.
    ws = await connect(url(app.port), compression=None, max_size=None, max_queue=1)
    await start(ws, id="s", text=TEXT * 20, format="f32", sample_rate=48_000, frame_ms=60)
    aborted = app.metrics.errors.labels(code="aborted")
    async with asyncio.timeout(30):
        while aborted._value.get() < 1:
            await asyncio.sleep(0.05)
    assert "send blocked for 0.5 s" in caplog.text
    ws.transport.abort()
