"""Ended streams kept for a resume hold no encoder, are counted and capped (issue #42, finding 2).

One keyless client that starts and cancels streams in a loop once grew the server's RSS
without bound: every cancelled stream was kept for the resume TTL with its encoder and
resampler (hundreds of KB for mp3 or Opus at 48 kHz), and ``--memory-budget-bytes`` did not
count them. Over real WebSocket connections against the fake engine: the kept streams stay
at ``--max-ended-streams-per-client`` (``--max-ended-streams`` in all), the one that ended
first goes first, the budget counts each running stream's encoder, and an ended stream's
encoder is freed at its end.
"""

from __future__ import annotations

import gc
import json
import weakref
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection

from server.app import App
from server.audio.base import FrameEncoder
from server.audio.footprint import encoder_state_bytes
from server.streams import builder as builder_module
from server.streams.lifecycle import StreamState
from server.streams.stream import Stream
from tests.integration.conftest import wait_until
from tests.wsclient import collect, open_client, recv_json, start

LONG = "A stream that is cancelled before it ends. " * 40
SHORT = "A short stream that completes."


def kept(app: App) -> list[Stream]:
    """Streams ended and kept only for a resume (delivered, or detached with their output ended)."""
    return [
        s
        for s in app.service.registry.all()
        if s.state is StreamState.DELIVERED or (s.state is StreamState.DETACHED and s.outbox.ended)
    ]


async def start_and_cancel(ws: ClientConnection, name: str, fmt: str) -> dict[str, Any]:
    """Start a long stream, cancel it once ``started`` came; its ``done`` message."""
    await start(ws, id=name, text=LONG, format=fmt, sample_rate=48_000)
    while (message := await recv_json_skipping_frames(ws))["type"] != "started":
        assert message["type"] != "error", message
    await ws.send(json.dumps({"type": "cancel", "id": name}))
    while (message := await recv_json_skipping_frames(ws))["type"] != "done":
        assert message["type"] != "error", message
    return message


async def recv_json_skipping_frames(ws: ClientConnection) -> dict[str, Any]:
    """The next text message; audio frames before it are dropped."""
    while True:
        try:
            return await recv_json(ws)
        except AssertionError:  # a binary frame
            continue


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
async def test_start_cancel_churn_keeps_ended_streams_at_the_cap_and_counts_encoders(
    make_app: Any, fmt: str
) -> None:
    cap = 5
    app: App = await make_app("--max-ended-streams-per-client", str(cap), "--resume-ttl-s", "300")
    ws, _ = await open_client(app.port)
    encoder_bytes = encoder_state_bytes(fmt, 48_000)
    for k in range(4 * cap):
        await start(ws, id=f"c{k}", text=LONG, format=fmt, sample_rate=48_000)
        started = await recv_json_skipping_frames(ws)
        assert started["type"] == "started", started
        [running] = [s for s in app.service.registry.all() if s.state is StreamState.ATTACHED]
        # The running stream's encoder and resampler are in its client's share of the budget.
        assert app.service.budget.of(running.client) >= encoder_bytes + len(kept(app)) * 1024
        await ws.send(json.dumps({"type": "cancel", "id": f"c{k}"}))
        while (message := await recv_json_skipping_frames(ws))["type"] != "done":
            assert message["type"] != "error", message
        assert message["reason"] == "cancelled"
        assert len(kept(app)) <= cap, f"{len(kept(app))} ended streams kept after {k + 1} (cap {cap})"
    await wait_until(lambda: len(kept(app)) == cap and len(app.service.registry) == cap, 10)
    # What they hold (their items, their own objects; no encoder) is what the budget counts.
    budget = app.service.budget
    assert budget.total == sum(s.buffered_bytes for s in app.service.registry.all()) > 0
    assert budget.total < cap * encoder_bytes, "an ended stream is charged for an encoder it no longer has"
    await ws.close()
    app.service.sweep()
    metrics = app.metrics.render().decode()
    assert f"chattts_buffered_bytes {float(budget.total)}" in metrics


async def test_an_ended_stream_frees_its_encoder(make_app: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[weakref.ref[FrameEncoder]] = []
    make = builder_module.stream_encoder

    def recording(*args: Any, **kwargs: Any) -> FrameEncoder:
        encoder = make(*args, **kwargs)
        built.append(weakref.ref(encoder))
        return encoder

    monkeypatch.setattr(builder_module, "stream_encoder", recording)
    app: App = await make_app("--resume-ttl-s", "300")
    ws, _ = await open_client(app.port)
    await start_and_cancel(ws, "cancelled", "mp3")
    await start(ws, id="complete", text=SHORT, format="opus", sample_rate=48_000)
    log = (await collect(ws, {"complete"}))["complete"]
    assert log.done is not None and log.done["reason"] == "complete"
    await wait_until(lambda: len(kept(app)) == 2, 10)
    gc.collect()
    assert len(built) == 2
    assert all(ref() is None for ref in built), "an ended stream, kept for a resume, still holds its encoder"
    # A resume still tells the stream's format, rate and Opus preskip (kept, not read from the encoder).
    token = log.started["stream"] if log.started else ""
    await ws.send(json.dumps({"type": "resume", "stream": token, "after_seq": log.done["last_seq"]}))
    resumed = await recv_json_skipping_frames(ws)
    assert resumed["type"] == "resumed", resumed
    assert {k: resumed[k] for k in ("format", "sample_rate", "preskip")} == {
        k: log.started[k] for k in ("format", "sample_rate", "preskip")
    }
    assert resumed["preskip"] == 312  # libopus' lookahead at 48 kHz
    await ws.close()


def all_ended(app: App) -> bool:
    """No stream is being sent any more (each delivered one is kept, or was freed)."""
    return not any(s.state is StreamState.ATTACHED for s in app.service.registry.all())


async def resume_outcome(ws: ClientConnection, token: str, after_seq: int) -> str:
    """``resumed`` or the error code a resume of ``token`` gets (the resumed stream's done is read)."""
    await ws.send(json.dumps({"type": "resume", "stream": token, "after_seq": after_seq}))
    message = await recv_json_skipping_frames(ws)
    if message["type"] == "error":
        return str(message["code"])
    assert message["type"] == "resumed", message
    while (message := await recv_json_skipping_frames(ws))["type"] != "done":
        pass
    return "resumed"


async def completed(ws: ClientConnection, names: list[str]) -> list[tuple[str, int]]:
    """Run short streams one after the other; (token, last seq) of each."""
    out = []
    for name in names:
        await start(ws, id=name, text=SHORT, format="pcm16")
        log = (await collect(ws, {name}))[name]
        assert log.started is not None and log.done is not None and log.done["reason"] == "complete"
        out.append((log.started["stream"], log.done["last_seq"]))
    return out


async def test_the_per_client_cap_frees_the_stream_that_ended_first(make_app: Any) -> None:
    app: App = await make_app("--max-ended-streams-per-client", "3", "--resume-ttl-s", "300")
    ws, _ = await open_client(app.port)
    streams = await completed(ws, [f"s{k}" for k in range(5)])
    await wait_until(lambda: all_ended(app), 10)
    outcomes = [await resume_outcome(ws, token, last) for token, last in streams]
    assert outcomes == ["unknown_stream", "unknown_stream", "resumed", "resumed", "resumed"]
    await ws.close()


async def test_the_global_cap_frees_the_stream_that_ended_first_whoever_its_client(make_app: Any) -> None:
    app: App = await make_app(
        "--max-ended-streams", "4", "--max-ended-streams-per-client", "3", "--resume-ttl-s", "300"
    )
    first, _ = await open_client(app.port)
    other, _ = await open_client(app.port, local_addr=("127.0.0.2", 0))
    mine = await completed(first, ["a0", "a1", "a2"])
    theirs = await completed(other, ["b0", "b1"])
    await wait_until(lambda: all_ended(app), 10)
    assert len(kept(app)) == 4
    assert [await resume_outcome(first, t, s) for t, s in mine] == ["unknown_stream", "resumed", "resumed"]
    assert [await resume_outcome(other, t, s) for t, s in theirs] == ["resumed", "resumed"]
    await first.close()
    await other.close()
