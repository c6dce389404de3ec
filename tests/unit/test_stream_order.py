from __future__ import annotations

import numpy as np

from server.engine.base import SynthesisParams
from server.stream_order import AudioChunk, SegmentStarted, StreamEvent, StreamOrder


def audio(value: float, n: int = 4) -> np.ndarray:
    return np.full(n, value, dtype=np.float32)


def order(segments: list[str]) -> StreamOrder:
    return StreamOrder(stream_id=0, params=SynthesisParams(), sink=lambda events: None, segments=segments)


def values(events: list[StreamEvent]) -> list[object]:
    return [
        e.index if isinstance(e, SegmentStarted) else float(e.audio[0])
        for e in events
        if isinstance(e, SegmentStarted | AudioChunk)
    ]


def test_lookahead_queues_one_ahead_and_held_segments_do_not_count() -> None:
    s = order(["a", "b", "c", "d"])
    assert s.segments_to_queue(lookahead=1) == [0, 1]
    assert s.segments_to_queue(lookahead=1) == []
    events: list[StreamEvent] = []
    s.on_audio(1, audio(1.0), True, events)  # segment 1 finished first: held
    assert events == [] and s.segments_to_queue(lookahead=1) == [2]


def test_audio_leaves_in_segment_order() -> None:
    s = order(["a", "b", "c"])
    s.segments_to_queue(lookahead=2)
    events: list[StreamEvent] = []
    s.on_audio(1, audio(1.0), False, events)
    s.on_audio(2, audio(2.0), True, events)
    s.on_audio(0, audio(0.0), False, events)
    assert values(events) == [0, 0.0]
    s.on_audio(1, audio(1.5), True, events)  # still held: segment 0 is not finished
    s.on_audio(0, audio(0.5), True, events)
    assert values(events) == [0, 0.0, 0.5, 1, 1.0, 1.5, 2, 2.0]
    assert s.maybe_complete()


def test_incremental_stream_completes_only_after_input_closes() -> None:
    s = order([])
    s.input_closed = False
    assert s.segments_to_queue(lookahead=1) == [] and not s.maybe_complete()
    s.segments.append("late")
    assert s.segments_to_queue(lookahead=1) == [0]
    s.on_audio(0, audio(1.0), True, [])
    assert not s.maybe_complete()
    s.input_closed = True
    assert s.maybe_complete()
