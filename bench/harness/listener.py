"""A simulated real-time listener with a jitter buffer.

The listener buffers arriving audio until it holds ``threshold_s`` seconds
(or the stream has ended), then plays at real time from the moment that
threshold arrived. When the buffer runs dry before the stream has ended it
counts an underrun, stalls, and re-buffers to the same threshold before it
plays again. Stall time is the total time playback was stopped after it
first started.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ListenerResult:
    """What a listener with one jitter-buffer threshold experienced.

    Attributes:
        threshold_ms: the start (and re-buffer) threshold.
        start_s: when playback started, seconds after the request was sent.
        underruns: times the buffer ran dry before the end of the stream.
        stall_s: total seconds playback was stopped after it first started.
        end_s: when the last sample finished playing, seconds after the request.
    """

    threshold_ms: float
    start_s: float | None
    underruns: int
    stall_s: float
    end_s: float | None


def simulate(arrivals: Sequence[tuple[float, float]], threshold_s: float) -> ListenerResult:
    """Play a stream through a jitter buffer.

    Args:
        arrivals: ``(arrival time, audio seconds)`` per frame, in arrival order,
            times relative to the request; the last entry is the stream's end.
        threshold_s: audio to hold before (re)starting playback.
    """
    received = 0.0  # audio seconds received so far
    total = sum(d for _, d in arrivals)
    playing = False
    play_clock = 0.0  # wall time when the current playing run started
    play_pos = 0.0  # audio position at play_clock
    stall_from: float | None = None
    start: float | None = None
    underruns = 0
    stall = 0.0
    for index, (t, duration) in enumerate(arrivals):
        if playing and duration > 0 and play_pos + (t - play_clock) > received:
            # The buffer ran dry before this frame's audio arrived (an empty end marker is no stall).
            underruns += 1
            stall_from = play_clock + (received - play_pos)
            play_pos = received
            playing = False
        received += duration
        last = index == len(arrivals) - 1
        if not playing and (received - play_pos >= threshold_s or (last and received > play_pos)):
            if start is None:
                start = t
            elif stall_from is not None:
                stall += t - stall_from
            playing, play_clock, stall_from = True, t, None
    end = play_clock + (total - play_pos) if start is not None else None
    return ListenerResult(threshold_s * 1000.0, start, underruns, stall, end)
