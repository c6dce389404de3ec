"""The WebSocket connection's protocol without sockets: client messages in, messages and actions out.

A real service over the fake engine's inference thread stands behind it; no
socket is opened. Every client message type, every error code a connection
can answer with, and the resume checks.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from server.app import server_info
from server.engine.fake import FAIL_MARKER
from server.errors import EngineFailed
from server.frontends.websocket import wire as protocol
from server.frontends.websocket.session import (
    Action,
    Attachment,
    Close,
    ConnectionProtocol,
    Send,
    StartPump,
    StopPump,
)
from server.streams.items import Done, Failure, Frame, OutItem, SegmentMark
from server.streams.lifecycle import StreamState
from server.streams.service import SpeechService
from tests.unit.conftest import MakeService


def connect(service: SpeechService, client: str = "ip:1") -> ConnectionProtocol:
    settings = service.settings
    aborted: list[str] = []
    conn = ConnectionProtocol(
        service,
        server_info(settings, service.engine.info),
        client=client,
        route=None,
        abort=aborted.append,
        metrics=service.metrics,
    )
    conn.aborted = aborted  # type: ignore[attr-defined]
    return conn


def send(conn: ConnectionProtocol, **message: Any) -> list[Action]:
    return conn.receive(json.dumps(message))


def replies(actions: list[Action]) -> list[dict[str, Any]]:
    return [json.loads(a.data) for a in actions if isinstance(a, Send)]


def error_of(actions: list[Action]) -> dict[str, Any]:
    [reply] = replies(actions)
    assert reply["type"] == "error", reply
    return reply


def start(conn: ConnectionProtocol, sid: str, text: str = "Hello there.", **fields: Any) -> Attachment:
    actions = send(conn, type="start", id=sid, text=text, **fields)
    started = replies(actions)[0]
    assert started["type"] == "started", started
    pump = actions[-1]
    assert isinstance(pump, StartPump) and pump.attachment.slot == started["slot"]
    return pump.attachment


async def until_ended(attachment: Attachment) -> list[OutItem]:
    """Every item of the stream once it ended (from the oldest still held)."""
    outbox = attachment.stream.outbox
    async with asyncio.timeout(10):
        while not outbox.ended:
            await outbox.wait_change()
    return outbox.ready(outbox.start_index)


# --- every client message type ----------------------------------------------------------------


async def test_hello_advertises_the_server(make_service: MakeService) -> None:
    conn = connect(await make_service("--max-streams", "3"))
    hello = json.loads(conn.hello())
    assert hello["type"] == "hello" and hello["protocol"] == 1 and hello["max_streams"] == 3
    assert "alto" in hello["voices"] and "opus" in hello["formats"]


async def test_start_answers_started_and_starts_a_pump_per_slot(make_service: MakeService) -> None:
    conn = connect(await make_service())
    actions = send(conn, type="start", id="a", text="One sentence.", seed=1, format="opus", sample_rate=48000)
    [started] = replies(actions)
    assert started["id"] == "a" and started["slot"] == 0 and started["format"] == "opus"
    assert started["sample_rate"] == 48000 and started["frame_ms"] == 20 and started["preskip"] > 0
    assert len(started["stream"]) >= 32
    assert isinstance(actions[1], StartPump) and actions[1].index == 0
    assert start(conn, "b").slot == 1
    assert set(conn.attached) == {"a", "b"}


async def test_cancel_ends_the_stream_cancelled(make_service: MakeService) -> None:
    conn = connect(await make_service("--fake-step-ms", "20"))
    attachment = start(conn, "c", "A long text that keeps the engine busy. " * 5)
    assert send(conn, type="cancel", id="c") == []
    items = await until_ended(attachment)
    assert isinstance(items[-1], Done) and items[-1].reason == "cancelled"


async def test_incremental_text_append_flush_end(make_service: MakeService) -> None:
    conn = connect(await make_service())
    attachment = start(conn, "i", "", incremental=True)
    assert send(conn, type="append", id="i", text="Hello world. And") == []
    assert send(conn, type="flush", id="i") == []
    assert send(conn, type="end", id="i") == []
    items = await until_ended(attachment)
    assert [m.text for m in items if isinstance(m, SegmentMark)] == ["Hello world.", "And"]
    assert isinstance(items[-1], Done) and items[-1].reason == "complete"
    assert error_of(send(conn, type="append", id="i", text="more"))["code"] == "bad_request"


async def test_render_puts_the_slot_on_every_message(make_service: MakeService) -> None:
    conn = connect(await make_service())
    start(conn, "x")
    attachment = start(conn, "y", "Render me.", seed=2)
    items = await until_ended(attachment)
    rendered = [conn.render(attachment, item) for item in items]
    frames = [protocol.unpack_frame(r) for r in rendered if isinstance(r, bytes)]
    assert frames and all(header.slot == 1 for header, _ in frames)
    messages = [json.loads(r) for r in rendered if isinstance(r, str)]
    assert [m["type"] for m in messages] == ["segment", "done"]
    assert all(m["slot"] == 1 and m["id"] == "y" for m in messages)
    assert messages[-1]["last_seq"] == frames[-1][0].seq and frames[-1][0].last
    failure = conn.render(attachment, Failure(9, EngineFailed("the model failed")))
    assert json.loads(failure) == {
        "type": "error",
        "id": "y",
        "code": "engine_error",
        "message": "the model failed",
    }


async def test_an_engine_failure_is_an_engine_error_then_done(make_service: MakeService) -> None:
    conn = connect(await make_service())
    attachment = start(conn, "f", f"This breaks {FAIL_MARKER}.")
    items = await until_ended(attachment)
    kinds = [type(i) for i in items if not isinstance(i, Frame)]
    assert kinds[-2:] == [Failure, Done]
    assert json.loads(conn.render(attachment, items[-2]))["code"] == "engine_error"


# --- every error code -------------------------------------------------------------------------

BAD = [
    ('{"type": "start", "id": ', "bad_request", None),
    ('{"type": "dance", "id": "x"}', "bad_request", "x"),
    ('{"type": "start", "text": "hi"}', "bad_request", None),
    ('{"type": "start", "id": "x"}', "bad_request", "x"),
    ('{"type": "start", "id": "x", "text": "。。。"}', "bad_request", "x"),
    ('{"type": "cancel", "id": "nope"}', "bad_request", "nope"),
    ('{"type": "append", "id": "nope", "text": "a"}', "bad_request", "nope"),
    ('{"type": "flush", "id": "nope"}', "bad_request", "nope"),
    ('{"type": "end", "id": "nope"}', "bad_request", "nope"),
    ('{"type": "start", "id": "x", "text": "hi", "format": "aac"}', "unsupported", "x"),
    ('{"type": "start", "id": "x", "text": "hi", "sample_rate": 44100}', "unsupported", "x"),
    ('{"type": "start", "id": "x", "text": "hi", "voice": "robot"}', "unsupported", "x"),
    ('{"type": "start", "id": "x", "text": "' + "a" * 2001 + '"}', "text_too_long", "x"),
    ('{"type": "resume", "stream": "not-a-token", "after_seq": 3}', "unknown_stream", None),
]


@pytest.mark.parametrize(("raw", "code", "sid"), BAD)
async def test_bad_messages_get_their_code(
    make_service: MakeService, raw: str, code: str, sid: str | None
) -> None:
    service = await make_service()
    conn = connect(service)
    err = error_of(conn.receive(raw))
    assert err["code"] == code and err.get("id") == sid and err["message"]
    assert f'chattts_errors_total{{code="{code}"}} 1.0' in service.metrics.render().decode()
    assert conn.attached == {}


async def test_binary_frames_are_refused(make_service: MakeService) -> None:
    conn = connect(await make_service())
    assert error_of(conn.receive(b"\x01\x02"))["code"] == "bad_request"


async def test_append_to_a_stream_without_incremental(make_service: MakeService) -> None:
    conn = connect(await make_service("--fake-step-ms", "20"))
    start(conn, "p", "Plain text here. " * 4)
    err = error_of(send(conn, type="append", id="p", text="more"))
    assert err["code"] == "bad_request" and "incremental" in err["message"]


async def test_incremental_limits_are_text_too_long(make_service: MakeService) -> None:
    conn = connect(await make_service("--max-pending-chars", "10", "--max-text-chars", "30"))
    start(conn, "i", "", incremental=True)
    assert error_of(send(conn, type="append", id="i", text="no sentence end yet"))["code"] == "text_too_long"
    send(conn, type="append", id="i", text="Short. ")
    assert error_of(send(conn, type="append", id="i", text="x" * 25))["code"] == "text_too_long"


async def test_duplicate_id_and_too_many_streams(make_service: MakeService) -> None:
    conn = connect(await make_service("--max-streams", "2", "--fake-step-ms", "20"))
    start(conn, "a", "Long enough to keep running. " * 4)
    assert error_of(send(conn, type="start", id="a", text="again"))["code"] == "duplicate_id"
    start(conn, "b", "Long enough to keep running. " * 4)
    err = error_of(send(conn, type="start", id="c", text="one too many"))
    assert err["code"] == "too_many_streams" and err["id"] == "c"


async def test_rate_limited_with_retry_after(make_service: MakeService) -> None:
    service = await make_service("--rate-limit-per-min", "6", "--rate-limit-burst", "1")
    conn = connect(service)
    start(conn, "a")
    err = error_of(send(conn, type="start", id="b", text="Limited."))
    assert err["code"] == "rate_limited" and 9000 <= err["retry_after_ms"] <= 10000
    other = connect(service, client="ip:2")  # another client is not limited by this one
    start(other, "b")


async def test_overloaded_with_retry_after(make_service: MakeService) -> None:
    conn = connect(await make_service("--max-queue", "0"))
    err = error_of(send(conn, type="start", id="o", text="Refused."))
    assert err["code"] == "overloaded" and err["retry_after_ms"] >= 250 and err["id"] == "o"
    assert conn.attached == {}


async def test_shutting_down_closes_an_idle_connection(make_service: MakeService) -> None:
    service = await make_service()
    conn = connect(service)
    service.draining = True
    actions = send(conn, type="start", id="late", text="Too late.")
    assert replies(actions)[0]["code"] == "shutting_down" and actions[-1] == Close(
        1012, "server is restarting"
    )


async def test_internal_when_the_inference_loop_is_gone(make_service: MakeService) -> None:
    service = await make_service()
    await service.engine.stop()
    err = error_of(send(connect(service), type="start", id="x", text="Nobody generates this."))
    assert err["code"] == "internal" and err["id"] == "x"


# --- resume -----------------------------------------------------------------------------------


async def test_resume_on_another_connection_moves_the_stream(make_service: MakeService) -> None:
    service = await make_service("--fake-step-ms", "20")
    first, second = connect(service), connect(service)
    old = start(first, "s", "A stream that moves to another connection. " * 3)
    actions = send(second, type="resume", stream=old.stream.token, after_seq=-1)
    [resumed] = replies(actions)
    assert resumed["type"] == "resumed" and resumed["id"] == "s" and resumed["after_seq"] == -1
    assert isinstance(actions[-1], StartPump) and actions[-1].index == 0
    assert old.lease.revoked and first.attached == {} and set(second.attached) == {"s"}
    # The old connection's pump ends when it sees its lease revoked; that changes nothing here.
    assert first.pump_ended(old) == [] and set(second.attached) == {"s"}


async def test_resumed_counts_the_text_messages_read_and_none_after_the_move(
    make_service: MakeService,
) -> None:
    service = await make_service("--fake-step-ms", "20")
    first, second = connect(service), connect(service)
    old = start(first, "s", "", incremental=True, max_buffer_delay_ms=60_000)
    assert send(first, type="append", id="s", text="One. ") == []
    assert send(first, type="flush", id="s") == []
    assert error_of(send(first, type="append", id="s", text="[nope]"))["code"] == "bad_request"  # read
    [resumed] = replies(send(second, type="resume", stream=old.stream.token, after_seq=-1))
    assert resumed["text_received"] == 3
    # The old connection no longer holds the stream: what it reads now is neither taken nor counted.
    assert error_of(send(first, type="append", id="s", text="Lost. "))["code"] == "bad_request"
    assert send(second, type="end", id="s") == []
    [again] = replies(send(first, type="resume", stream=old.stream.token, after_seq=-1))
    assert again["text_received"] == 4
    plain = start(first, "p", "Not incremental.")
    [resumed_plain] = replies(send(second, type="resume", stream=plain.stream.token, after_seq=-1))
    assert "text_received" not in resumed_plain


async def test_resume_on_the_same_connection_stops_the_old_pump_first(make_service: MakeService) -> None:
    conn = connect(await make_service("--fake-step-ms", "20"))
    old = start(conn, "s", "Resumed where it runs. " * 3, format="opus")
    actions = send(conn, type="resume", stream=old.stream.token, after_seq=-1)
    assert isinstance(actions[0], StopPump) and actions[0].attachment is old
    assert replies(actions)[0]["preskip"] > 0
    assert isinstance(actions[-1], StartPump) and actions[-1].attachment.slot == 0


async def test_resume_checks_room_and_expiry_before_touching_the_stream(make_service: MakeService) -> None:
    service = await make_service("--max-streams", "1", "--replay-max-s", "0.05", "--fake-step-ms", "1")
    first, second = connect(service), connect(service)
    moving = start(first, "s", "This stream is evicted while detached. " * 6, seed=1)
    start(second, "busy", "Occupies the only slot. " * 6)
    err = error_of(send(second, type="resume", stream=moving.stream.token, after_seq=-1))
    assert err["code"] == "too_many_streams" and not moving.lease.revoked
    first.connection_lost()
    assert moving.stream.state is StreamState.DETACHED
    await until_ended(moving)
    err = error_of(send(connect(service), type="resume", stream=moving.stream.token, after_seq=0))
    assert err["code"] == "resume_expired" and err["id"] == "s" and err["stream"] == moving.stream.token


async def test_resume_with_a_live_id_is_a_duplicate(make_service: MakeService) -> None:
    service = await make_service("--fake-step-ms", "20")
    first, second = connect(service), connect(service)
    moving = start(first, "same", "Long enough to keep running. " * 4)
    start(second, "same", "Another stream with the same id. " * 4)
    assert error_of(send(second, type="resume", stream=moving.stream.token))["code"] == "duplicate_id"


# --- the connection's end -------------------------------------------------------------------------


async def test_connection_lost_detaches_or_frees(make_service: MakeService) -> None:
    for ttl, state in (("30", StreamState.DETACHED), ("0", StreamState.EXPIRED)):
        service = await make_service("--resume-ttl-s", ttl, "--fake-step-ms", "20")
        conn = connect(service)
        attachment = start(conn, "d", "Keeps running after the connection is gone. " * 3)
        conn.connection_lost()
        assert attachment.stream.state is state and conn.attached == {}
        assert (service.registry.get(attachment.stream.token) is not None) == (ttl != "0")


async def test_done_delivered_frees_the_slot_and_a_drain_closes(make_service: MakeService) -> None:
    service = await make_service()
    conn = connect(service)
    attachment = start(conn, "s", "Short.")
    sent: list[OutItem] = []
    async for items in attachment.stream.deliver(attachment.lease, 0):
        sent.extend(items)
    assert isinstance(sent[-1], Done) and attachment.stream.state is StreamState.DELIVERED
    service.draining = True
    assert conn.pump_ended(attachment) == [Close(1012, "server is restarting")]
    assert conn.attached == {}


async def deliver_all(conn: ConnectionProtocol, attachment: Attachment) -> list[Action]:
    """Send every item of ``attachment`` as its pump would, then tell the connection it ended."""
    async with asyncio.timeout(10):
        async for _ in attachment.stream.deliver(attachment.lease, 0):
            pass
    return conn.pump_ended(attachment)


async def test_a_cancel_racing_done_is_ignored_but_unknown_ids_stay_errors(make_service: MakeService) -> None:
    service = await make_service("--max-streams", "2")
    conn = connect(service)
    await deliver_all(conn, start(conn, "a", "Short."))
    # The client sent ``cancel`` before it read ``done``: nothing is left to stop, nothing is wrong.
    assert send(conn, type="cancel", id="a") == []
    assert error_of(send(conn, type="cancel", id="never"))["code"] == "bad_request"
    # Only a cancel is forgiven: text for an ended stream is still refused (it would be lost).
    assert error_of(send(conn, type="append", id="a", text="More."))["code"] == "bad_request"
    # The memory is bounded by --max-streams: two newer ended streams push "a" out.
    await deliver_all(conn, start(conn, "b", "Short."))
    await deliver_all(conn, start(conn, "c", "Short."))
    assert send(conn, type="cancel", id="c") == [] and send(conn, type="cancel", id="b") == []
    assert error_of(send(conn, type="cancel", id="a"))["code"] == "bad_request"


async def test_a_cancel_for_a_stream_that_moved_away_is_an_error(make_service: MakeService) -> None:
    service = await make_service("--fake-step-ms", "20")
    first, second = connect(service), connect(service)
    old = start(first, "s", "A stream that moves to another connection. " * 3)
    send(second, type="resume", stream=old.stream.token, after_seq=-1)
    assert first.pump_ended(old) == []
    assert error_of(send(first, type="cancel", id="s"))["code"] == "bad_request"


async def test_invalid_messages_past_their_rate_close_the_connection(make_service: MakeService) -> None:
    service = await make_service("--invalid-messages-per-s", "3")
    now = [0.0]
    conn = ConnectionProtocol(
        service,
        server_info(service.settings, service.engine.info),
        client="ip:1",
        route=None,
        abort=lambda reason: None,
        metrics=service.metrics,
        clock=lambda: now[0],
    )
    bad = [
        {"type": "cancel", "id": "nobody"},
        {"type": "start", "id": "x", "text": "hi", "format": "aac"},
        {"type": "resume", "stream": "not-a-token"},
    ]
    for message in bad:  # three at once are allowed
        actions = send(conn, **message)
        assert not any(isinstance(a, Close) for a in actions) and error_of(actions)
    actions = send(conn, type="cancel", id="nobody")
    assert error_of(actions)["code"] == "bad_request"
    assert actions[-1] == Close(1008, "too many invalid messages")
    now[0] = 1.0  # a second later the bucket is full again: forgiven
    fresh = connect(service)
    for _ in range(3):
        assert not any(isinstance(a, Close) for a in send(fresh, type="cancel", id="nobody"))
    # The server's own refusals are not the client's fault and are never counted.
    counted = ConnectionProtocol(
        await make_service("--invalid-messages-per-s", "1", "--max-queue", "0"),
        server_info(service.settings, service.engine.info),
        client="ip:2",
        route=None,
        abort=lambda reason: None,
        metrics=service.metrics,
        clock=lambda: now[0],
    )
    for k in range(5):
        actions = send(counted, type="start", id=f"s{k}", text="Hello there.")
        assert error_of(actions)["code"] == "overloaded" and not any(isinstance(a, Close) for a in actions)
