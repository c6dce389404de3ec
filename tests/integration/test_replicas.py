"""Resume across replicas (in one process): forwarded to the owner, or regenerated when it is gone."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import InvalidStatus

from server.app import App
from server.streams.routing import Router
from tests.integration.conftest import MakeApp, fake_engine, wait_until
from tests.integration.test_voices import encoded, form, recording, upload
from tests.resumer import Taken, open_ws, take, unbroken
from tests.wsclient import recv, recv_json

SECRET = "replica-test-secret-0123456789"
TEXT = "First sentence of the story. 第二句话在这里。And the third one ends it. A fourth, short."
REPLICA = ("--resume-secret", SECRET, "--cache-bytes", "0", "--fake-step-ms", "3")


def router_of(app: App) -> Router:
    router = app.service.router
    assert router is not None
    return router


async def start_and_cut(
    port: int, start: dict[str, Any], cut_after: int, api_key: str | None = None
) -> Taken:
    """Start a stream on ``port`` and lose the connection after ``cut_after`` frames."""
    taken = Taken(start)
    ws = await open_ws(port, api_key=api_key)
    await ws.send(json.dumps({"type": "start", **start}))
    assert await take(ws, taken, cut_after) == "cut"
    return taken


async def resume_on(port: int, taken: Taken, api_key: str | None = None, **options: Any) -> str:
    """Reconnect to ``port``, resume, and take the rest of the stream."""
    ws = await open_ws(port, taken.token, api_key=api_key)
    await ws.send(json.dumps(taken.resume(**options)))
    outcome = await take(ws, taken)
    await ws.close()
    return outcome


async def test_started_reports_the_seed_it_picked_and_tokens_name_their_owner(make_app: MakeApp) -> None:
    a = await make_app(*REPLICA)
    ws = await open_ws(a.port)
    await ws.send(json.dumps({"type": "start", "id": "s", "text": "No seed given."}))
    started = await recv_json(ws)
    assert isinstance(started["seed"], int) and 0 <= started["seed"] < 2**63
    claims = router_of(a).verify(started["stream"])
    assert claims is not None and claims.owner == f"ws://127.0.0.1:{a.port}"
    await ws.close()


@pytest.mark.parametrize("fmt", ["pcm16", "opus"])
async def test_a_resume_on_another_replica_is_forwarded_to_the_owner(make_app: MakeApp, fmt: str) -> None:
    a, b = await make_app(*REPLICA), await make_app(*REPLICA)
    start = {"id": "s", "text": TEXT, "seed": 7, "format": fmt}
    expected = await unbroken(a.port, start)
    taken = await start_and_cut(a.port, start, cut_after=5)
    assert await resume_on(b.port, taken) == "done"
    assert taken.signature() == expected.signature()
    resumed = next(m for m in taken.messages if m["type"] == "resumed")
    assert resumed["stream"] == taken.token and resumed["after_seq"] == 4
    assert b.metrics.resumes.labels(how="forwarded")._value.get() == 1
    assert a.metrics.resumes.labels(how="local")._value.get() == 1


FORMATS: list[tuple[Any, ...]] = [("pcm16", 24000), ("f32", 24000), ("mulaw", 24000), ("pcm16", 16000)]
FORMATS += [("opus", 24000)]
FORMATS += [("opus", 48000), ("ogg", 24000), ("mp3", 24000), ("flac", 24000), ("mulaw", 8000)]
# Longer frames (``frame_ms``): PCM goes on from its segment on the 60 ms grid, Opus from the start.
FORMATS += [("pcm16", 24000, 60), ("mulaw", 24000, 40), ("opus", 48000, 60)]


@pytest.mark.parametrize("case", FORMATS, ids=lambda case: "-".join(map(str, case)))
async def test_a_stream_whose_owner_is_gone_is_regenerated_byte_for_byte(
    make_app: MakeApp, case: tuple[Any, ...]
) -> None:
    a, b = await make_app(*REPLICA), await make_app(*REPLICA)
    fmt, rate, frame_ms = (*case, 20)[:3]
    start = {"id": "s", "text": TEXT, "seed": 11, "format": fmt, "sample_rate": rate}
    if frame_ms != 20:
        start["frame_ms"] = frame_ms
    expected = await unbroken(b.port, start)
    taken = await start_and_cut(a.port, start, cut_after=int(len(expected.frames) * 0.6))
    assert len(taken.marks) >= 2  # the cut is past the first segment
    await a.stop()  # the owner is gone (its port is closed: the forward is refused at once)
    assert await resume_on(b.port, taken) == "done"
    assert taken.signature() == expected.signature()
    resumed = next(m for m in taken.messages if m["type"] == "resumed")
    assert router_of(b).verify(resumed["stream"]).owner == router_of(b).advertise_url  # type: ignore[union-attr]
    assert not any(m["type"] == "resume_degraded" for m in taken.messages)
    assert b.metrics.resumes.labels(how="regenerated")._value.get() == 1


async def test_a_stream_in_an_openai_voice_name_is_regenerated_as_that_voice(make_app: MakeApp) -> None:
    """The token signs the resolved voice (``nova`` is ``seed:16``); the resent ``start`` resolves alike."""
    a, b = await make_app(*REPLICA), await make_app(*REPLICA)
    start = {"id": "s", "text": TEXT, "seed": 11, "voice": "nova"}
    expected = await unbroken(b.port, start)
    assert expected.signature() != (await unbroken(b.port, {**start, "voice": "default"})).signature()
    taken = await start_and_cut(a.port, start, cut_after=int(len(expected.frames) * 0.6))
    await a.stop()
    assert await resume_on(b.port, taken) == "done"
    assert taken.signature() == expected.signature()
    assert b.metrics.resumes.labels(how="regenerated")._value.get() == 1


async def test_pcm_regenerates_only_from_the_segment_that_holds_the_resume_point(make_app: MakeApp) -> None:
    a, b = await make_app(*REPLICA), await make_app(*REPLICA)
    start = {"id": "s", "text": TEXT, "seed": 3}
    expected = await unbroken(b.port, start)
    taken = await start_and_cut(a.port, start, cut_after=int(len(expected.frames) * 0.7))
    await a.stop()
    resume = taken.resume()
    assert resume["segment"] >= 2  # of 4 segments
    engine = fake_engine(b)
    events_before = len(engine.events)
    ws = await open_ws(b.port)
    await ws.send(json.dumps(resume))
    assert await take(ws, taken) == "done"
    assert taken.signature() == expected.signature()
    added = [seq for kind, seq in list(engine.events)[events_before:] if kind == "add"]
    assert len(added) == 4 - resume["segment"]  # the segments before were not generated again


async def test_an_owner_lost_while_it_is_relayed_is_regenerated_without_the_client_noticing(
    make_app: MakeApp,
) -> None:
    a = await make_app("--resume-secret", SECRET, "--cache-bytes", "0", "--fake-step-ms", "40")
    b = await make_app(*REPLICA)
    start = {"id": "s", "text": TEXT * 3, "seed": 5}
    expected = await unbroken(b.port, start)
    taken = await start_and_cut(a.port, start, cut_after=3)
    ws = await open_ws(b.port, taken.token)
    await ws.send(json.dumps(taken.resume()))
    assert await take(ws, taken, pause_after=20) == "paused"  # relayed from the owner
    assert taken.done is None and b.metrics.resumes.labels(how="forwarded")._value.get() == 1
    await a.stop()  # the owner goes away mid-stream
    assert await take(ws, taken) == "done"  # the same connection, the same slot
    assert taken.signature() == expected.signature()
    assert [m["type"] for m in taken.messages].count("resumed") == 1
    assert b.metrics.resumes.labels(how="regenerated")._value.get() == 1
    await ws.close()


async def test_a_regeneration_that_cannot_be_exact_says_so(make_app: MakeApp) -> None:
    a = await make_app(*REPLICA)
    b = await make_app(*REPLICA, "--opus-bitrate", "24000")  # another encoder setting than the owner's
    start = {"id": "s", "text": TEXT, "seed": 2, "format": "opus"}
    taken = await start_and_cut(a.port, start, cut_after=10)
    token = taken.token
    await a.stop()
    assert await resume_on(b.port, taken) == "done"
    degraded = [m for m in taken.messages if m["type"] == "resume_degraded"]
    assert len(degraded) == 1 and "encoder settings differ" in degraded[0]["reason"]
    assert degraded[0]["id"] == "s" and degraded[0]["stream"] == token
    kinds = [m["type"] for m in taken.messages]
    assert kinds.index("resume_degraded") < kinds.index("resumed")
    assert b.metrics.resumes.labels(how="degraded")._value.get() == 1


async def test_only_the_streams_tenant_can_resume_it_on_another_replica(
    make_app: MakeApp, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("[alpha]\nkey-alpha\n[beta]\nkey-beta\n")
    flags = (*REPLICA, "--api-keys-file", str(keys))
    a, b = await make_app(*flags), await make_app(*flags)
    start = {"id": "s", "text": TEXT, "seed": 4}
    expected = await unbroken(b.port, start, api_key="key-alpha")
    taken = await start_and_cut(a.port, start, cut_after=4, api_key="key-alpha")

    async def refused_for_beta() -> dict[str, Any]:
        ws = await open_ws(b.port, taken.token, api_key="key-beta")
        await ws.send(json.dumps(taken.resume()))
        error = await recv_json(ws)
        await ws.close()
        assert error["type"] == "error" and error["code"] == "unknown_stream", error
        return error

    await refused_for_beta()  # forwarded to the owner, which checks the tenant as on one replica
    await a.stop()
    assert "not the stream's" in (await refused_for_beta())["message"]  # gone: no regeneration either
    assert await resume_on(b.port, taken, api_key="key-alpha") == "done"
    assert taken.signature() == expected.signature()


async def test_a_regeneration_costs_the_resuming_client_one_stream_token(make_app: MakeApp) -> None:
    a = await make_app(*REPLICA)
    b = await make_app(*REPLICA, "--rate-limit-per-min", "1", "--rate-limit-burst", "2")
    taken = await start_and_cut(a.port, {"id": "s", "text": TEXT, "seed": 4}, cut_after=4)
    await a.stop()
    assert await resume_on(b.port, taken) == "done"  # regenerated on b: one of its two tokens
    ws = await open_ws(b.port)
    await ws.send(json.dumps({"type": "start", "id": "next", "text": "One more.", "seed": 1}))
    assert (await recv_json(ws))["type"] == "started"  # the second token was left
    await ws.close()


async def test_refinement_makes_a_regeneration_degraded(make_app: MakeApp) -> None:
    a, b = await make_app(*REPLICA), await make_app(*REPLICA)
    taken = await start_and_cut(a.port, {"id": "r", "text": TEXT, "seed": 2, "refine": True}, cut_after=4)
    await a.stop()
    assert await resume_on(b.port, taken) == "done"
    degraded = [m for m in taken.messages if m["type"] == "resume_degraded"]
    assert len(degraded) == 1 and "refinement" in degraded[0]["reason"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"request": None}, "the stream is gone"),
        ({"text": "Another text entirely."}, "not the stream's"),
        ({"seed": 12345}, "not the stream's"),
        ({"incremental": True}, "incremental"),
    ],
)
async def test_a_stream_that_cannot_be_regenerated_is_refused(
    make_app: MakeApp, change: dict[str, Any], message: str
) -> None:
    a, b = await make_app(*REPLICA), await make_app(*REPLICA)
    taken = await start_and_cut(a.port, {"id": "s", "text": TEXT, "seed": 4}, cut_after=4)
    await a.stop()
    resume = taken.resume()
    if "request" in change:
        del resume["request"]
    else:
        resume["request"] |= change
    ws = await open_ws(b.port)
    await ws.send(json.dumps(resume))
    error = await recv_json(ws)
    assert error["type"] == "error" and error["code"] == "unknown_stream", error
    assert message in error["message"] and error["stream"] == taken.token
    # The connection serves on.
    await ws.send(json.dumps({"type": "start", "id": "next", "text": "Still here.", "seed": 1}))
    assert (await recv_json(ws))["type"] == "started"
    await ws.close()


async def test_a_second_resume_elsewhere_moves_a_forwarded_stream(make_app: MakeApp) -> None:
    a = await make_app("--resume-secret", SECRET, "--cache-bytes", "0", "--fake-step-ms", "30")
    b, c = await make_app(*REPLICA), await make_app(*REPLICA)
    start = {"id": "s", "text": TEXT * 2, "seed": 8}
    expected = await unbroken(c.port, start)
    taken = await start_and_cut(a.port, start, cut_after=2)
    first = await open_ws(b.port, taken.token)
    await first.send(json.dumps(taken.resume()))
    assert await take(first, taken, pause_after=3) == "paused"
    # The client moves it again (it thinks the first reconnect failed): from c, to the owner.
    second = await open_ws(c.port, taken.token)
    await second.send(json.dumps(taken.resume()))
    assert await take(second, taken) == "done"
    assert taken.signature() == expected.signature()
    # b's relay of it ended quietly: b holds nothing, and its connection serves on.
    await wait_until(lambda: b.metrics.forwarded_streams._value.get() == 0)
    await first.send(json.dumps({"type": "start", "id": "s", "text": "Free slot and id.", "seed": 1}))
    while isinstance(raw := await recv(first), bytes) or json.loads(raw)["type"] == "segment":
        pass  # what b relayed before the move
    assert json.loads(raw)["type"] == "started"
    await first.close()
    await second.close()


async def test_a_draining_owner_still_serves_forwarded_resumes_of_its_streams(make_app: MakeApp) -> None:
    a = await make_app("--resume-secret", SECRET, "--cache-bytes", "0", "--fake-step-ms", "30")
    b = await make_app(*REPLICA)
    start = {"id": "s", "text": TEXT * 2, "seed": 6}
    expected = await unbroken(b.port, start)
    taken = await start_and_cut(a.port, start, cut_after=2)
    drain = asyncio.create_task(a.drain())
    try:
        await wait_until(lambda: a.draining)
        with pytest.raises(InvalidStatus) as refused:  # a client's new connection is refused
            await open_ws(a.port)
        assert refused.value.response.status_code == 503
        assert await resume_on(b.port, taken) == "done"  # forwarded: the owner serves it
        assert taken.signature() == expected.signature()
        async with asyncio.timeout(10):
            await drain  # nothing is left to wait for
    finally:
        drain.cancel()
        await asyncio.gather(drain, return_exceptions=True)
    assert a.metrics.resumes.labels(how="local")._value.get() == 1


async def test_a_voice_from_a_recording_fails_over_where_the_replica_has_it(
    make_app: MakeApp, tmp_path: Path
) -> None:
    shared = tmp_path / "voices"
    a = await make_app(*REPLICA, "--voices-dir", str(shared), "--http-port", "-1")
    status, voice = await upload(a, form(encoded(recording())))
    assert status == 200, voice
    b = await make_app(*REPLICA, "--voices-dir", str(shared))  # shares a's folder
    c = await make_app(*REPLICA, "--voices-dir", str(tmp_path / "empty"))  # lacks the voice
    start = {"id": "v", "text": TEXT, "seed": 3, "voice": voice["id"]}
    expected = await unbroken(a.port, start)
    taken = await start_and_cut(a.port, start, cut_after=6)
    await a.stop()
    ws = await open_ws(c.port)
    await ws.send(json.dumps(taken.resume()))
    error = await recv_json(ws)
    assert error["code"] == "unsupported" and "unknown voice" in error["message"], error
    assert error["stream"] == taken.token
    await ws.close()
    assert await resume_on(b.port, taken) == "done"
    assert taken.signature() == expected.signature()


async def test_forwarding_and_regeneration_never_log_a_token_in_full(
    make_app: MakeApp, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="server")
    a, b, c = await make_app(*REPLICA), await make_app(*REPLICA), await make_app(*REPLICA)
    taken = await start_and_cut(a.port, {"id": "s", "text": TEXT, "seed": 1}, cut_after=3)
    first = taken.token
    assert await take_some_then_cut(b.port, taken) == "cut"  # forwarded to a
    await a.stop()
    assert await resume_on(c.port, taken) == "done"  # a is gone: regenerated on c
    assert first is not None and taken.token != first
    assert "regenerated" in caplog.text and "Unreachable" in caplog.text
    for token in (first, taken.token):
        assert token not in caplog.text and token[:40] not in caplog.text


async def take_some_then_cut(port: int, taken: Taken) -> str:
    ws = await open_ws(port, taken.token)
    await ws.send(json.dumps(taken.resume()))
    return await take(ws, taken, cut_after=3)
