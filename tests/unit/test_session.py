from __future__ import annotations

import pytest

from server.audio.base import EncodedFrame
from server.protocol import FLAG_LAST, FLAG_SEGMENT_START
from server.session import BufferOverflow, ResumeExpired, StreamSession, new_stream_token, redact
from server.streams import StreamRegistry

FRAME = EncodedFrame(b"\x00" * 960, 480)


def session(**kwargs: object) -> StreamSession:
    options: dict[str, object] = {
        "client_id": "s",
        "fmt": "pcm16",
        "sample_rate": 24000,
        "max_unsent_s": 10.0,
        "replay_max_s": 1.0,
        "replay_max_bytes": 1 << 20,
    }
    options.update(kwargs)
    return StreamSession(**options)  # type: ignore[arg-type]


def test_frames_are_numbered_and_segments_marked_at_their_exact_sample() -> None:
    s = session()
    s.on_segment("one")
    s.on_frames([FRAME, FRAME], 960)
    s.on_segment("two")  # starts at native sample 960: the start of frame 2
    s.on_frames([FRAME], 480)
    s.finish("complete", [EncodedFrame(b"\x00" * 10, 5)])
    items = [s.item(i) for i in range(s.end_index)]
    kinds = [(it.message["type"] if it.message else "frame", it.position) for it in items if it]
    assert kinds == [
        ("segment", 0),
        ("frame", 0),
        ("frame", 1),
        ("segment", 2),
        ("frame", 2),
        ("frame", 3),
        ("done", 4),
    ]
    frames = [it for it in items if it and it.is_frame]
    assert [f.sample for f in frames] == [0, 480, 960, 1440]
    assert frames[0].flags & FLAG_SEGMENT_START and frames[2].flags & FLAG_SEGMENT_START
    assert frames[-1].flags & FLAG_LAST and not frames[-2].flags & FLAG_LAST
    done = items[-1]
    assert done is not None and done.message == {
        "type": "done",
        "id": "s",
        "reason": "complete",
        "last_seq": 3,
        "samples": 1445,
    }


def test_detached_replay_buffer_never_exceeds_its_bounds() -> None:
    s = session(replay_max_s=0.5, replay_max_bytes=20_000)
    for _ in range(500):
        s.on_frames([FRAME], 480)
        assert s.held_bytes <= 20_000
    # 0.5 s of audio = 25 frames of 20 ms; the byte bound (20 frames of 960 B) is tighter.
    assert s.held_bytes == 20 * 960
    with pytest.raises(ResumeExpired):
        s.rewind_to(10)
    index = s.rewind_to(495)
    item = s.item(index)
    assert item is not None and item.position == 496


def test_attached_sender_is_never_overtaken_and_unsent_audio_is_bounded() -> None:
    s = session(replay_max_s=0.1, max_unsent_s=1.0)
    s.owner = object()
    for _ in range(50):  # 1.0 s unsent: allowed, and nothing unsent is evicted
        s.on_frames([FRAME], 480)
    assert s.item(0) is not None
    with pytest.raises(BufferOverflow):
        s.on_frames([FRAME], 480)
    s.mark_sent(s.end_index)  # once sent, the replay bound applies
    assert s.held_bytes <= 5 * 960


def test_tokens_are_long_random_and_redacted() -> None:
    tokens = {new_stream_token() for _ in range(1000)}
    assert len(tokens) == 1000
    assert all(len(t) >= 32 for t in tokens)  # 192 bits as base64url
    token = next(iter(tokens))
    assert redact(token) == token[:6] + "…"


def test_registry_expires_detached_streams_after_ttl() -> None:
    now = [0.0]
    registry = StreamRegistry(ttl_s=30, clock=lambda: now[0])

    class FakeStream:
        def __init__(self) -> None:
            self.session = session()
            self.token = self.session.token
            self.delivered = False

    a, b = FakeStream(), FakeStream()
    registry.add(a, owner="conn")  # type: ignore[arg-type]
    registry.add(b, owner="conn")  # type: ignore[arg-type]
    registry.detach(a)  # type: ignore[arg-type]
    now[0] = 29.9
    assert registry.expired() == []
    now[0] = 30.0
    assert registry.expired() == [a]
    assert registry.get(b.token) is b and registry.active == 2


def test_route_prefixed_tokens_for_ingress_affinity() -> None:
    token = new_stream_token("req-42_A")
    route, _, secret = token.partition(".")
    assert route == "req-42_A" and len(secret) == 32
    assert redact(token) == f"req-42_A.{secret[:6]}…"
    # Anything that is not a plain id is ignored rather than copied into the token.
    assert "." not in new_stream_token("bad id/with.stuff") and "." not in new_stream_token("x" * 65)
