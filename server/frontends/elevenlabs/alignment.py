"""A segment's timed words as ElevenLabs' character alignment.

ElevenLabs times characters, not words: ``{"chars", "charStartTimesMs", "charDurationsMs"}``
on the WebSocket, ``{"characters", "character_start_times_seconds",
"character_end_times_seconds"}`` on REST. Ours are words (:class:`~server.streams.outbox.Words`),
so each word's span is shared evenly by its characters, a space joins two words (it holds the
pause between them), and a last space runs to the segment's end, so that one segment's
characters cover its audio exactly and the next segment's begin where they stop: clients
that add up each alignment's span as a clock (pipecat does) stay on the audio's timeline.
"""

from __future__ import annotations

import itertools
from typing import Any

from server.streams.items import Words


def char_times(words: Words, sample_rate: int, origin: int) -> tuple[list[str], list[int]]:
    """The segment's characters and their boundaries in ms from sample ``origin`` (one more than chars).

    Boundaries are rounded once each, so the durations (their differences) add up exactly.
    """
    chars: list[str] = []
    bounds: list[float] = []
    for word in words.words:  # a leading silence is before the first character's start
        n = len(word.text)
        for i, char in enumerate(word.text):
            chars.append(char)
            bounds.append(word.start + (word.end - word.start) * i / n)
        chars.append(" ")  # to the next word's start, or the segment's end
        bounds.append(word.end)
    if not chars:  # no word: one space holds the segment's span
        chars.append(" ")
        bounds.append(words.start)
    bounds.append(words.end)
    scale = 1000 / sample_rate
    return chars, [round((b - origin) * scale) for b in bounds]


def ws_alignment(words: Words, sample_rate: int, origin: int) -> dict[str, Any]:
    """The WebSocket's alignment of one segment, times in ms from sample ``origin``."""
    chars, ms = char_times(words, sample_rate, origin)
    return {
        "chars": chars,
        "charStartTimesMs": ms[:-1],
        "charDurationsMs": [b - a for a, b in itertools.pairwise(ms)],
    }


def rest_alignment(words: Words, sample_rate: int) -> dict[str, Any]:
    """REST's alignment of one segment (``with-timestamps``), seconds from the response's start."""
    chars, ms = char_times(words, sample_rate, 0)
    return {
        "characters": chars,
        "character_start_times_seconds": [t / 1000 for t in ms[:-1]],
        "character_end_times_seconds": [t / 1000 for t in ms[1:]],
    }
