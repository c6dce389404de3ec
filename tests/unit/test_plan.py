from __future__ import annotations

import numpy as np

from server.core.events import Audio, SegmentStarted, StreamEvent
from server.core.plan import StreamPlan
from server.engine_api import SynthesisParams


def audio(value: float, n: int = 4) -> np.ndarray:
    return np.full(n, value, dtype=np.float32)


def plan(segments: list[str]) -> StreamPlan:
    return StreamPlan(stream_id=0, params=SynthesisParams(), segments=segments)


def values(events: list[StreamEvent]) -> list[object]:
    return [
        e.index if isinstance(e, SegmentStarted) else float(e.samples[0])
        for e in events
        if isinstance(e, SegmentStarted | Audio)
    ]


def test_lookahead_queues_one_ahead_and_held_segments_do_not_count() -> None:
    s = plan(["a", "b", "c", "d"])
    assert s.segments_to_queue(lookahead=1) == [0, 1]
    assert s.segments_to_queue(lookahead=1) == []
    assert s.on_audio(1, audio(1.0), True) == []  # segment 1 finished first: held
    assert s.segments_to_queue(lookahead=1) == [2]


def test_audio_leaves_in_segment_order() -> None:
    s = plan(["a", "b", "c"])
    s.segments_to_queue(lookahead=2)
    events: list[StreamEvent] = []
    events += s.on_audio(1, audio(1.0), False)
    events += s.on_audio(2, audio(2.0), True)
    events += s.on_audio(0, audio(0.0), False)
    assert values(events) == [0, 0.0]
    events += s.on_audio(1, audio(1.5), True)  # still held: segment 0 is not finished
    events += s.on_audio(0, audio(0.5), True)
    assert values(events) == [0, 0.0, 0.5, 1, 1.0, 1.5, 2, 2.0]
    assert s.complete


def test_incremental_stream_completes_only_after_input_closes() -> None:
    s = plan([])
    s.input_closed = False
    assert s.segments_to_queue(lookahead=1) == [] and not s.complete
    s.segments.append("late")
    assert s.segments_to_queue(lookahead=1) == [0]
    s.on_audio(0, audio(1.0), True)
    assert not s.complete
    s.input_closed = True
    assert s.complete
