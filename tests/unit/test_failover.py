"""Planning a regeneration: where it starts, what is refused, what is degraded; the outbox and relay parts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from server.audio import make_encoder
from server.audio.base import EncodedFrame
from server.engine_api import EngineInfo
from server.errors import InvalidRequest, UnknownStream
from server.frontends.websocket.handoff import Progress, reslot_frame, reslot_message
from server.frontends.websocket.wire import HEADER, Resume
from server.streams.failover import Regeneration, ResumePoint, plan
from server.streams.items import Done, Frame, SegmentMark
from server.streams.outbox import Outbox
from server.streams.request import SpeechRequest
from server.streams.routing import Claims, request_digest

FAKE = EngineInfo(name="fake", voices=("default",), samples_per_token=512)
PRINT = b"P" * 8
REQUEST = SpeechRequest(name="s", text="One. Two. Three.", seed=5)


def claims_for(request: SpeechRequest, fingerprint: bytes = PRINT) -> Claims:
    return Claims("ws://10.0.0.1:8080", fingerprint, request_digest(request))


def planned(request: SpeechRequest, point: ResumePoint, **kwargs: object) -> Regeneration:
    options: dict[str, object] = {"segments": 3, "fingerprint": PRINT, "engine": FAKE} | kwargs
    return plan(request, claims_for(request), point, **options)  # type: ignore[arg-type]


def test_pcm_at_the_native_rate_starts_at_the_clients_segment() -> None:
    regen = planned(REQUEST, ResumePoint(after_seq=40, segment=1, segment_sample=9000))
    assert (regen.first_segment, regen.native_start, regen.skip_through, regen.degraded) == (
        1,
        9000,
        40,
        None,
    )


@pytest.mark.parametrize(("fmt", "rate"), [("opus", 24000), ("ogg", 24000), ("mp3", 24000), ("pcm16", 16000)])
def test_stateful_encoders_and_resampling_start_over_from_the_first_segment(fmt: str, rate: int) -> None:
    request = dataclasses.replace(REQUEST, format=fmt, sample_rate=rate)
    regen = planned(request, ResumePoint(after_seq=40, segment=1, segment_sample=9000))
    assert (regen.first_segment, regen.native_start, regen.skip_through) == (0, 0, 40)


def test_without_segment_info_it_starts_over() -> None:
    assert planned(REQUEST, ResumePoint(after_seq=40)).first_segment == 0


@pytest.mark.parametrize(
    ("point", "message"),
    [
        (ResumePoint(10, segment=3, segment_sample=100), "the text has 3 segments"),
        (ResumePoint(10, segment=1, segment_sample=11 * 480 + 1), "lies after the resume point"),
        (ResumePoint(10, segment=0, segment_sample=5), "segment 0 starts at sample 0"),
    ],
)
def test_an_impossible_resume_point_is_a_bad_request(point: ResumePoint, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        planned(REQUEST, point)


def test_the_resume_point_may_be_the_segment_start_itself() -> None:
    assert planned(REQUEST, ResumePoint(10, segment=1, segment_sample=11 * 480)).native_start == 11 * 480


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (dataclasses.replace(REQUEST, seed=None), "without its seed"),
        (dataclasses.replace(REQUEST, incremental=True), "incremental"),
    ],
)
def test_what_cannot_be_regenerated_is_refused(request_: SpeechRequest, message: str) -> None:
    with pytest.raises(UnknownStream, match=message):
        plan(request_, claims_for(request_), ResumePoint(3), segments=3, fingerprint=PRINT, engine=FAKE)


def test_a_request_that_is_not_the_tokens_is_refused() -> None:
    other = dataclasses.replace(REQUEST, text="Something else.")
    with pytest.raises(UnknownStream, match="not the stream's"):
        plan(other, claims_for(REQUEST), ResumePoint(3), segments=1, fingerprint=PRINT, engine=FAKE)


def test_only_the_streams_tenant_can_regenerate_it() -> None:
    claims = Claims("ws://10.0.0.1:8080", PRINT, request_digest(REQUEST, "tenant-a"))
    point, kwargs = ResumePoint(3), {"segments": 3, "fingerprint": PRINT, "engine": FAKE}
    assert plan(REQUEST, claims, point, owner="tenant-a", **kwargs).first_segment == 0  # type: ignore[arg-type]
    for other in ("tenant-b", None):
        with pytest.raises(UnknownStream, match="not the stream's"):
            plan(REQUEST, claims, point, owner=other, **kwargs)  # type: ignore[arg-type]


def test_what_cannot_be_exact_is_degraded() -> None:
    assert "differ" in (plan(REQUEST, claims_for(REQUEST, b"Q" * 8), ResumePoint(3), segments=3,
                             fingerprint=PRINT, engine=FAKE).degraded or "")  # fmt: skip
    refined = dataclasses.replace(REQUEST, refine=True)
    assert "refinement" in (planned(refined, ResumePoint(3)).degraded or "")
    bf16 = EngineInfo(name="chattts", voices=(), samples_per_token=512, extra={"dtype": "bfloat16"})
    assert "bfloat16" in (planned(REQUEST, ResumePoint(3), engine=bf16).degraded or "")
    f32 = dataclasses.replace(bf16, extra={"dtype": "float32"})
    assert planned(REQUEST, ResumePoint(3), engine=f32).degraded is None


def pcm_stream(outbox: Outbox, audio: np.ndarray, segment_starts: list[int]) -> None:
    """Feed ``audio`` through a fresh pcm16 encoder into ``outbox`` in 700-sample chunks."""
    encoder = make_encoder("pcm16", 24000)
    for i, start in enumerate(segment_starts):
        end = segment_starts[i + 1] if i + 1 < len(segment_starts) else len(audio)
        outbox.on_segment(f"seg{i}")
        for at in range(start, end, 700):
            chunk = audio[at : min(at + 700, end)]
            outbox.on_frames(encoder.push(chunk), len(chunk))
    outbox.finish("complete", encoder.finish())


def new_outbox() -> Outbox:
    return Outbox(sample_rate=24000, max_unsent_s=60, replay_max_s=60, replay_max_bytes=1 << 24)


def items_after(outbox: Outbox, after_seq: int) -> list[object]:
    return [item for item in outbox.ready(outbox.start_index) if item.position > after_seq]


def test_a_pcm_stream_regenerated_from_a_segment_gives_the_same_items_after_the_resume_point() -> None:
    rng = np.random.default_rng(0)
    audio = rng.uniform(-0.5, 0.5, 24000).astype(np.float32)
    starts = [0, 5321, 9600, 13007, 20000]  # 9600: on the 20 ms grid
    whole = new_outbox()
    pcm_stream(whole, audio, starts)
    # (after_seq, the last segment whose mark the client took: its seq at most after_seq)
    for after_seq, segment in [(12, 0), (12, 1), (20, 2), (25, 2), (27, 3), (41, 4), (49, 4)]:
        assert starts[segment] // 480 <= after_seq
        regen = Regeneration(segment, starts[segment], after_seq)
        encoder = make_encoder("pcm16", 24000)
        outbox = new_outbox()
        regen.prepare(encoder, outbox)
        for i in range(segment, len(starts)):
            end = starts[i + 1] if i + 1 < len(starts) else len(audio)
            outbox.on_segment(f"seg{i}")
            for at in range(starts[i], end, 700):
                chunk = audio[at : min(at + 700, end)]
                outbox.on_frames(encoder.push(chunk), len(chunk))
        outbox.finish("complete", encoder.finish())
        assert items_after(outbox, -1) == items_after(whole, after_seq), (after_seq, segment)
        assert outbox.unsent_samples == sum(
            f.samples for f in items_after(whole, after_seq) if isinstance(f, Frame)
        )


def test_a_regenerated_outbox_keeps_done_and_refuses_resumes_before_its_start() -> None:
    outbox = new_outbox()
    outbox.start_at(seq=0, sample=0, native=0, skip_through=5)
    outbox.on_segment("a")
    outbox.on_frames([EncodedFrame(b"\x00\x00" * 480, 480)] * 7, 7 * 480)  # seq 0..6
    outbox.finish("complete", [])  # seq 7, the last
    items = outbox.ready(outbox.start_index)
    assert isinstance(items[-1], Done) and not any(isinstance(i, SegmentMark) for i in items)
    assert outbox.snapshot() is None  # never cached
    with pytest.raises(Exception, match="no longer held"):
        outbox.check_resumable(4)
    outbox.check_resumable(5)


def test_progress_counts_a_segment_once_its_frame_went_out() -> None:
    progress = Progress(after_seq=9, segment=1, segment_sample=4000)
    progress.mark(12, 5900, 2)
    progress.frame(10)
    progress.frame(11)
    assert progress.point() == ResumePoint(11, 1, 4000)  # the mark's frame is not out yet
    progress.frame(12)
    assert progress.point() == ResumePoint(12, 2, 5900)
    progress.mark(8, 100, 7)  # a replayed mark before the resume point: already counted
    progress.frame(13)
    assert progress.point() == ResumePoint(13, 2, 5900)


def test_relayed_items_get_this_connections_slot() -> None:
    frame = HEADER.pack(1, 3, 7, 41, 19680) + b"payload"
    reslotted, seq = reslot_frame(frame, 2)
    assert seq == 41 and reslotted == HEADER.pack(1, 3, 2, 41, 19680) + b"payload"
    message, data = reslot_message('{"type":"segment","id":"s","slot":7,"seq":3,"text":"你好"}', 0)
    assert message["slot"] == 0 and '"slot":0' in data and "你好" in data
    unchanged = '{"type":"error","code":"resume_expired"}'
    assert reslot_message(unchanged, 4)[1] == unchanged
    with pytest.raises(ValueError):
        reslot_frame(b"short", 1)
    with pytest.raises(ValueError):
        reslot_message("[1]", 1)


def test_resume_takes_the_request_and_the_segment_it_stands_in() -> None:
    import msgspec

    raw = (
        '{"type":"resume","stream":"t","after_seq":4,"segment":1,"segment_sample":2000,'
        '"request":{"type":"start","id":"s","text":"Hi.","seed":3}}'
    )
    resume = msgspec.json.decode(raw, type=Resume)
    assert resume.request is not None and resume.request.seed == 3 and resume.segment == 1
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode('{"type":"resume","stream":"t","segment":-1}', type=Resume)
