from __future__ import annotations

import pytest

from server.audio.base import EncodedFrame
from server.errors import ResumeExpired
from server.streams.items import Done, Frame, SegmentMark
from server.streams.outbox import BufferOverflow, Outbox
from server.streams.tokens import new_stream_token, redact

FRAME = EncodedFrame(b"\x00" * 960, 480)


def outbox(**kwargs: object) -> Outbox:
    options: dict[str, object] = {
        "sample_rate": 24000,
        "max_unsent_s": 10.0,
        "replay_max_s": 1.0,
        "replay_max_bytes": 1 << 20,
    }
    options.update(kwargs)
    return Outbox(**options)  # type: ignore[arg-type]


def test_frames_are_numbered_and_segments_marked_at_their_exact_sample() -> None:
    s = outbox()
    s.on_segment("one")
    s.on_frames([FRAME, FRAME], 960)
    s.on_segment("two")  # starts at native sample 960: the start of frame 2
    s.on_frames([FRAME], 480)
    s.finish("complete", [EncodedFrame(b"\x00" * 10, 5)])
    items = s.ready(0)
    kinds = [(type(it).__name__, it.position) for it in items]
    assert kinds == [
        ("SegmentMark", 0),
        ("Frame", 0),
        ("Frame", 1),
        ("SegmentMark", 2),
        ("Frame", 2),
        ("Frame", 3),
        ("Done", 4),
    ]
    frames = [it for it in items if isinstance(it, Frame)]
    assert [f.sample for f in frames] == [0, 480, 960, 1440]
    assert frames[0].segment_start and frames[2].segment_start and not frames[1].segment_start
    assert frames[-1].last and not frames[-2].last
    assert [m.text for m in items if isinstance(m, SegmentMark)] == ["one", "two"]
    assert items[-1] == Done(4, "complete", last_seq=3, samples=1445)


def test_detached_replay_buffer_never_exceeds_its_bounds() -> None:
    s = outbox(replay_max_s=0.5, replay_max_bytes=20_000)
    s.attached = False
    for _ in range(500):
        s.on_frames([FRAME], 480)
        assert s.held_bytes <= 20_000
    # 0.5 s of audio = 25 frames of 20 ms; the byte bound (20 frames of 960 B) is tighter.
    assert s.held_bytes == 20 * 960
    with pytest.raises(ResumeExpired):
        s.rewind_to(10)
    index = s.rewind_to(495)
    assert s.ready(index)[0].position == 496


def test_attached_sender_is_never_overtaken_and_unsent_audio_is_bounded() -> None:
    s = outbox(replay_max_s=0.1, max_unsent_s=1.0)
    for _ in range(50):  # 1.0 s unsent: allowed, and nothing unsent is evicted
        s.on_frames([FRAME], 480)
    assert s.ready(0)
    with pytest.raises(BufferOverflow):
        s.on_frames([FRAME], 480)
    s.mark_sent(s.end_index)  # once sent, the replay bound applies
    assert s.held_bytes <= 5 * 960


def test_a_cached_stream_loads_whole() -> None:
    first = outbox()
    first.on_segment("hi")
    first.on_frames([FRAME], 480)
    first.finish("complete", [])
    items = first.snapshot()
    assert items is not None
    second = outbox()
    second.load(items)
    assert second.ended and second.ready(0) == items


def test_tokens_are_long_random_and_redacted() -> None:
    tokens = {new_stream_token() for _ in range(1000)}
    assert len(tokens) == 1000
    assert all(len(t) >= 32 for t in tokens)  # 192 bits as base64url
    token = next(iter(tokens))
    assert redact(token) == token[:6] + "…"


def test_route_prefixed_tokens_for_ingress_affinity() -> None:
    token = new_stream_token("req-42_A")
    route, _, secret = token.partition(".")
    assert route == "req-42_A" and len(secret) == 32
    assert redact(token) == f"req-42_A.{secret[:6]}…"
    # Anything that is not a plain id is ignored rather than copied into the token.
    assert "." not in new_stream_token("bad id/with.stuff") and "." not in new_stream_token("x" * 65)
