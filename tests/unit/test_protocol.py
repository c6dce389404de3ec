from __future__ import annotations

import json

import pytest

from server.frontends.websocket import wire as protocol
from server.frontends.websocket.wire import (
    FLAG_LAST,
    FLAG_SEGMENT_START,
    Cancel,
    FrameHeader,
    ProtocolError,
    Start,
    parse_client_message,
    unpack_frame,
)
from server.streams.items import Frame


def test_header_round_trip_is_12_bytes_little_endian() -> None:
    header = FrameHeader(flags=FLAG_LAST | FLAG_SEGMENT_START, slot=3, seq=0x01020304, sample=0xA0B0C0D0)
    item = Frame(
        position=0x01020304, payload=b"abc", sample=0xA0B0C0D0, samples=1, last=True, segment_start=True
    )
    frame = protocol.frame(3, item)  # what the server sends
    assert frame[:12] == bytes([1, 3, 3, 0, 4, 3, 2, 1, 0xD0, 0xC0, 0xB0, 0xA0])
    parsed, payload = unpack_frame(frame)
    assert parsed == header and payload == b"abc" and parsed.last and parsed.segment_start


@pytest.mark.parametrize("frame", [b"", b"\x01" * 11, b"\x02" + b"\x00" * 11])
def test_unpack_rejects_short_or_unknown_version(frame: bytes) -> None:
    with pytest.raises(ValueError):
        unpack_frame(frame)


def test_start_defaults_and_fields() -> None:
    msg = parse_client_message('{"type":"start","id":"a","text":"hi","seed":1,"top_k":5,"extra":true}')
    assert isinstance(msg, Start)
    assert (msg.format, msg.sample_rate, msg.voice, msg.speed, msg.seed, msg.top_k) == (
        "pcm16",
        24000,
        "default",
        1.0,
        1,
        5,
    )
    assert msg.temperature is None and not msg.incremental


def test_cancel() -> None:
    assert parse_client_message('{"type":"cancel","id":"a"}') == Cancel(id="a")


@pytest.mark.parametrize(
    ("raw", "fragment", "sid"),
    [
        ("{", "malformed JSON", None),
        ("[]", "Expected `object`", None),
        ('{"type":"nope","id":"z"}', "unknown or missing message type", "z"),
        ('{"type":"start","id":7}', "`$.id`", None),
        ('{"type":"start","id":"q","speed":3}', "`$.speed`", "q"),
        ('{"type":"start","id":""}', "`$.id`", None),
        ('{"type":"start","id":"' + "x" * 200 + '"}', "`$.id`", None),
    ],
)
def test_invalid_messages_name_the_problem(raw: str, fragment: str, sid: str | None) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_client_message(raw)
    assert caught.value.code == "bad_request"
    assert fragment in caught.value.message
    assert caught.value.name == sid


def test_binary_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="binary"):
        parse_client_message(b"{}")


def test_error_message_shape() -> None:
    err = ProtocolError("overloaded", "busy", name="s", retry_after_ms=300)
    assert json.loads(protocol.error(err)) == {
        "type": "error",
        "code": "overloaded",
        "message": "busy",
        "id": "s",
        "retry_after_ms": 300,
    }
    assert protocol.encode({"a": "é"}) == '{"a":"é"}'


def test_every_domain_error_has_its_wire_code() -> None:
    from server import errors

    kinds = [k for k in vars(errors).values() if isinstance(k, type) and issubclass(k, errors.ServiceError)]
    assert {protocol.code_of(k("x")) for k in kinds if k is not errors.ServiceError} == {
        "bad_request",
        "text_too_long",
        "unsupported",
        "rate_limited",
        "overloaded",
        "shutting_down",
        "engine_error",
        "internal",
        "unknown_stream",
        "resume_expired",
        "not_found",
        "limit_reached",
    }
    assert protocol.code_of(errors.ServiceError("x")) == "internal"
    wire = protocol.wire_error(errors.Overloaded("busy", retry_after_ms=5), name="s")
    assert (wire.code, wire.name, wire.retry_after_ms) == ("overloaded", "s", 5)
