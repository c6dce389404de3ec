"""Word timestamps of one stream: each segment's audio kept until it ends, then its words timed.

A stream started with ``word_timestamps`` keeps the native samples of the segment being
spoken (:class:`SegmentWords`); when the engine says a segment's last samples have come
(``Audio.segment_end``), the aligner times its words on that audio, and the stream puts them
in its outbox before those last samples are numbered, so a client gets a segment's words no
later than the frame that holds its last sample. The method itself (text → words, words and
audio → spans) is :mod:`server.text.words`; this module only feeds it, and is bounded by the
longest segment the engine makes (``--segment-max-tokens``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from server.engine_api import NATIVE_SAMPLE_RATE, AudioArray
from server.text import words

log = logging.getLogger(__name__)

#: (segment text, its audio, sample rate) → its words as (text, start, end) sample offsets.
Aligner = Callable[[str, AudioArray, int], Sequence[tuple[str, int, int]]]


def align_segment(text: str, samples: AudioArray, sample_rate: int) -> list[tuple[str, int, int]]:
    """The words of ``text`` timed on its audio (the method of :mod:`server.text.words`).

    Tags and sounds (``[laugh]``) give no word. A segment too short to hold its words
    (fewer samples than words) gives none.
    """
    try:
        timed = words.align(words.spoken_words(text), samples, sample_rate)
    except ValueError as exc:
        log.warning("no word timestamps for a segment of %d samples: %s", len(samples), exc)
        return []
    return [(w.word, w.start, w.end) for w in timed if w.word]


class SegmentWords:
    """The audio of the segment being spoken, and its words once it ends.

    Args:
        aligner: times a segment's words on its audio (:func:`align_segment`).
    """

    def __init__(self, aligner: Aligner = align_segment) -> None:
        self._aligner = aligner
        self._text = ""
        self._chunks: list[AudioArray] = []

    def start(self, text: str) -> None:
        """A new segment starts (its text as the engine speaks it)."""
        self._text = text
        self._chunks = []

    def add(self, samples: AudioArray) -> None:
        """More native samples of the current segment."""
        if len(samples):
            self._chunks.append(samples)

    def finish(self) -> tuple[Sequence[tuple[str, int, int]], int]:
        """The current segment ended: its words (native sample offsets from its start) and its length.

        Runs the aligner (CPU work: call it off the event loop) and forgets the audio.
        """
        chunks, self._chunks = self._chunks, []
        audio = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
        return self._aligner(self._text, audio, NATIVE_SAMPLE_RATE), len(audio)
