"""Resume after reconnect: nothing lost, byte for byte, and every error case."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import ClientConnection, connect

from server.app import App
from server.engine.fake import FakeEngine
from tests.integration.conftest import fake_settings
from tests.wsclient import collect, open_client, recv, recv_json, start, url

TEXT = "First sentence of the story. 第二句话在这里。And the third one ends it."
RESUME_FLAGS = ("--fake-step-ms", "3", "--resume-ttl-s", "30")


async def unbroken(port: int, fmt: str, seed: int) -> dict[int, bytes]:
    """Every frame (header + payload) of an unbroken run, by seq, plus done as seq -1."""
    ws, _ = await open_client(port)
    await start(ws, id="s", text=TEXT, seed=seed, format=fmt)
    log = (await collect(ws, {"s"}))["s"]
    await ws.close()
    assert log.done is not None
    frames = {
        f.header.seq: bytes([f.header.flags]) + f.header.sample.to_bytes(4, "little") + f.payload
        for f in log.frames
    }
    frames[-1] = json.dumps({k: v for k, v in log.done.items() if k != "slot"}, sort_keys=True).encode()
    return frames


async def read_until_cut(ws: ClientConnection, got: dict[int, bytes], cut_after: int | None) -> str | None:
    """Receive into ``got``; abort the socket after ``cut_after`` new frames. Returns the token if started."""
    token = None
    new = 0
    while True:
        raw = await recv(ws)
        if isinstance(raw, bytes):
            seq = int.from_bytes(raw[4:8], "little")
            got.setdefault(seq, raw[1:2] + raw[8:12] + raw[12:])
            new += 1
            if cut_after is not None and new >= cut_after:
                ws.transport.abort()  # the network goes away; no close handshake
                return token
            continue
        msg = json.loads(raw)
        if msg["type"] in ("started", "resumed"):
            token = msg["stream"]
        elif msg["type"] == "done":
            got[-1] = json.dumps({k: v for k, v in msg.items() if k != "slot"}, sort_keys=True).encode()
            await ws.close()
            return token
        elif msg["type"] == "error":
            raise AssertionError(msg)


async def generation_ended(app: App, token: str | None) -> None:
    """Wait until the server has generated all of the stream behind ``token`` (10 s at most)."""
    assert token is not None
    stream = app.service.registry.get(token)
    assert stream is not None
    async with asyncio.timeout(10):
        while not stream.outbox.ended:
            await asyncio.sleep(0.01)


def contiguous_last(got: dict[int, bytes]) -> int:
    seq = -1
    while seq + 1 in got:
        seq += 1
    return seq


async def broken_run(port: int, fmt: str, seed: int, cuts: list[int]) -> dict[int, bytes]:
    got: dict[int, bytes] = {}
    ws, _ = await open_client(port)
    await start(ws, id="s", text=TEXT, seed=seed, format=fmt)
    token = await read_until_cut(ws, got, cuts[0])
    assert token is not None
    for cut in [*cuts[1:], None]:
        if -1 in got:
            break
        # Reconnect (with the affinity query parameter a load balancer would hash on).
        ws = await connect(url(port) + f"?resume={token}", compression=None, max_size=None)
        assert json.loads(await recv(ws))["type"] == "hello"
        await ws.send(json.dumps({"type": "resume", "stream": token, "after_seq": contiguous_last(got)}))
        await read_until_cut(ws, got, cut)
    return got


@pytest.mark.parametrize("fmt", ["pcm16", "opus", "mp3", "flac", "mulaw"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(1, 40), min_size=1, max_size=3), seed=st.integers(0, 1000))
def test_cut_and_resume_reassembles_the_unbroken_stream(fmt: str, cuts: list[int], seed: int) -> None:
    async def scenario() -> None:
        app = App(fake_settings(*RESUME_FLAGS))
        await app.start()
        try:
            expected = await unbroken(app.port, fmt, seed)
            got = await broken_run(app.port, fmt, seed, cuts)
            assert got == expected
        finally:
            await app.stop()

    uvloop.run(scenario())


async def test_unknown_stream(app: App) -> None:
    ws, _ = await open_client(app.port)
    await ws.send(json.dumps({"type": "resume", "stream": "not-a-token", "after_seq": 3}))
    err = await recv_json(ws)
    assert err["code"] == "unknown_stream" and err["stream"] == "not-a-token" and "id" not in err
    await start(ws, id="ok", text="still fine.", seed=1)
    assert (await collect(ws, {"ok"}))["ok"].done is not None
    await ws.close()


async def test_resume_after_done_replays_the_rest_and_done(make_app: Any) -> None:
    app = await make_app(*RESUME_FLAGS)
    expected = await unbroken(app.port, "pcm16", 5)
    got: dict[int, bytes] = {}
    ws, _ = await open_client(app.port)
    await start(ws, id="s", text=TEXT, seed=5)
    token = await read_until_cut(ws, got, 3)
    await generation_ended(app, token)
    ws2, _ = await open_client(app.port)
    await ws2.send(json.dumps({"type": "resume", "stream": token, "after_seq": contiguous_last(got)}))
    resumed = await recv_json(ws2)
    assert resumed["type"] == "resumed" and resumed["id"] == "s" and resumed["after_seq"] == 2
    await read_until_cut(ws2, got, None)
    assert got == expected
    # Delivered and done: the stream is freed.
    async with asyncio.timeout(5):
        while app.active_streams:
            await asyncio.sleep(0.01)


async def test_resume_expired_when_needed_frames_were_evicted(make_app: Any) -> None:
    app = await make_app(*RESUME_FLAGS, "--replay-max-s", "0.2")
    ws, _ = await open_client(app.port)
    await start(ws, id="s", text=TEXT * 3, seed=2)
    token = await read_until_cut(ws, {}, 2)
    await generation_ended(app, token)
    ws2, _ = await open_client(app.port)
    await ws2.send(json.dumps({"type": "resume", "stream": token, "after_seq": 1}))
    err = await recv_json(ws2)
    assert err["code"] == "resume_expired" and "no longer held" in err["message"]
    assert err["id"] == "s" and err["stream"] == token
    await ws2.close()


async def test_ttl_expiry_frees_engine_work_and_forgets_the_token(make_app: Any) -> None:
    app = await make_app("--fake-step-ms", "60", "--resume-ttl-s", "0.3")
    ws, _ = await open_client(app.port)
    await start(ws, id="s", text=TEXT * 4, seed=2)
    token = await read_until_cut(ws, {}, 1)
    engine = app.engine_client.engine
    assert isinstance(engine, FakeEngine) and engine.live_sequences > 0
    async with asyncio.timeout(10):
        while engine.live_sequences or app.active_streams:
            await asyncio.sleep(0.01)
    ws2, _ = await open_client(app.port)
    await ws2.send(json.dumps({"type": "resume", "stream": token, "after_seq": 0}))
    assert (await recv_json(ws2))["code"] == "unknown_stream"
    await ws2.close()


async def test_second_resume_moves_the_stream(make_app: Any) -> None:
    app = await make_app("--fake-step-ms", "30", "--resume-ttl-s", "30")
    first, _ = await open_client(app.port)
    await start(first, id="s", text=TEXT, seed=9)
    token = (await recv_json(first))["stream"]
    second, _ = await open_client(app.port)
    await second.send(json.dumps({"type": "resume", "stream": token, "after_seq": -1}))
    log = (await collect(second, {"s"}))["s"]
    assert log.started is not None and log.started["type"] == "resumed"
    assert log.done is not None and log.frames[0].header.seq == 0
    assert [f.header.seq for f in log.frames] == list(range(len(log.frames)))
    # The first connection stopped getting frames for it, and remains usable.
    await start(first, id="other", text="still usable.", seed=1)
    other = (await collect(first, {"other"}))["other"]
    assert other.done is not None
    await first.close()
    await second.close()


async def test_tokens_are_never_logged_in_full(make_app: Any, caplog: pytest.LogCaptureFixture) -> None:
    # Everything the server logs, at its most verbose. (websockets' own frame tracing would
    # print message bodies at DEBUG; the CLI keeps that logger at WARNING or above.)
    caplog.set_level(logging.DEBUG, logger="server")
    app = await make_app(*RESUME_FLAGS)
    got: dict[int, bytes] = {}
    ws, _ = await open_client(app.port)
    await start(ws, id="s", text=TEXT, seed=1)
    token = await read_until_cut(ws, got, 2)
    assert token is not None
    ws2, _ = await open_client(app.port)
    await ws2.send(json.dumps({"type": "resume", "stream": token, "after_seq": contiguous_last(got)}))
    await read_until_cut(ws2, got, None)
    assert "resumed after seq" in caplog.text
    assert token not in caplog.text and token[:12] not in caplog.text


async def test_token_carries_the_ingress_request_id(app: App) -> None:
    ws, _ = await open_client(app.port, additional_headers={"X-Request-ID": "abc123"})
    await start(ws, id="s", text="Routed.", seed=1)
    started = await recv_json(ws)
    assert started["stream"].startswith("abc123.") and len(started["stream"]) == len("abc123.") + 32
    await ws.close()


async def test_opus_started_announces_preskip_and_resume_on_the_same_connection(make_app: Any) -> None:
    app = await make_app("--fake-step-ms", "20")
    ws, _ = await open_client(app.port)
    await start(ws, id="o", text=TEXT, seed=3, format="opus")
    started = await recv_json(ws)
    assert started["preskip"] == 156 and started["format"] == "opus"
    # The client believes it missed frames: it resumes on the very same connection.
    await ws.send(json.dumps({"type": "resume", "stream": started["stream"], "after_seq": -1}))
    log = (await collect(ws, {"o"}, slots={started["slot"]: "o"}))["o"]
    assert log.started is not None and log.started["type"] == "resumed" and log.started["preskip"] == 156
    seqs = [f.header.seq for f in log.frames]
    assert set(seqs) == set(range(max(seqs) + 1))  # everything, duplicates allowed before the resume
    assert log.done is not None and log.done["last_seq"] == max(seqs)
    await ws.close()


@pytest.mark.parametrize("generated", [True, False], ids=["finished", "generating"])
async def test_resume_past_the_streams_end_is_refused(make_app: Any, generated: bool) -> None:
    """Issue #25, finding 6: an ``after_seq`` the stream never reached answers an error, not silence.

    The refusal changes nothing: the same token then resumes from a real seq and the stream
    completes with every frame.
    """
    app = await make_app("--fake-step-ms", "3" if generated else "80", "--resume-ttl-s", "30")
    expected = await unbroken(app.port, "pcm16", 4) if generated else None
    got: dict[int, bytes] = {}
    ws, _ = await open_client(app.port)
    await start(ws, id="s", text=TEXT * (1 if generated else 6), seed=4)
    token = await read_until_cut(ws, got, 2)
    assert token is not None
    past = [2**20, 2**32 - 1]
    if expected is not None:
        await generation_ended(app, token)
        past.insert(0, json.loads(expected[-1])["last_seq"] + 1)  # one past the last frame
    ws2, _ = await open_client(app.port)
    for after_seq in past:
        await ws2.send(json.dumps({"type": "resume", "stream": token, "after_seq": after_seq}))
        err = await recv_json(ws2)
        assert err["type"] == "error" and err["code"] == "bad_request", err
        assert err["stream"] == token and err["id"] == "s" and "past" in err["message"]
    await ws2.send(json.dumps({"type": "resume", "stream": token, "after_seq": contiguous_last(got)}))
    await read_until_cut(ws2, got, None)
    assert -1 in got and set(got) == set(range(-1, json.loads(got[-1])["last_seq"] + 1))
    if expected is not None:
        assert got == expected
