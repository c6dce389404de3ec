"""What the inference loop knows about one stream: its segments, their order, its events.

Pure bookkeeping on the loop thread (no engine, no locks): which segments
to queue next (look-ahead), and how step results become the stream's
events in order — audio of the segment being heard goes out at once, audio
of look-ahead segments is held until the segments before it have finished.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from server.engine.base import AudioArray, SynthesisParams
from server.protocol import ProtocolError

# --- events delivered to the event loop -------------------------------------


@dataclass(frozen=True, slots=True)
class SegmentStarted:
    """Segment ``index`` (text ``text``) starts with the next audio."""

    index: int
    text: str


@dataclass(frozen=True, slots=True)
class AudioChunk:
    """New native-rate samples of the stream, in order."""

    audio: AudioArray


@dataclass(frozen=True, slots=True)
class StreamEnded:
    """No more events follow. ``error`` is set when ``reason`` is ``error``."""

    reason: Literal["complete", "cancelled", "error"]
    error: ProtocolError | None = None


StreamEvent = SegmentStarted | AudioChunk | StreamEnded
EventSink = Callable[[list[StreamEvent]], None]


@dataclass(eq=False)
class StreamOrder:
    """One stream as the loop thread sees it."""

    stream_id: int
    params: SynthesisParams
    sink: EventSink
    segments: list[str] = field(default_factory=list)
    input_closed: bool = True
    next_to_queue: int = 0  # index of the next segment to queue
    emit_index: int = 0  # segment whose audio goes out now
    announced: int = -1  # highest segment index whose SegmentStarted was sent
    held: dict[int, list[AudioArray]] = field(default_factory=dict)
    finished_segments: set[int] = field(default_factory=set)
    live_seqs: dict[int, int] = field(default_factory=dict)  # seq_id -> segment index
    ended: bool = False

    def segments_to_queue(self, lookahead: int) -> list[int]:
        """Segments to queue now, so that fewer than ``1 + lookahead`` are unfinished.

        Segments that finished ahead of their turn (held audio) do not count, so a
        short segment never stalls the pipeline; the held ones are capped too, which
        bounds the audio a stream can hold back.
        """
        width = 1 + lookahead
        held = len(self.finished_segments)
        unfinished = self.next_to_queue - self.emit_index - held
        queued = []
        while (
            not self.ended
            and self.next_to_queue < len(self.segments)
            and unfinished < width
            and held <= width
        ):
            queued.append(self.next_to_queue)
            self.next_to_queue += 1
            unfinished += 1
        return queued

    def on_audio(self, segment: int, audio: AudioArray, finished: bool, events: list[StreamEvent]) -> None:
        """A step's output for ``segment``: append the events it releases, in order."""
        if segment == self.emit_index:
            self._announce(events)
            if len(audio):
                events.append(AudioChunk(audio))
        elif len(audio):
            self.held.setdefault(segment, []).append(audio)
        if finished:
            self.finished_segments.add(segment)
            self._advance_emit(events)

    def _announce(self, events: list[StreamEvent]) -> None:
        if self.announced < self.emit_index:
            self.announced = self.emit_index
            events.append(SegmentStarted(self.emit_index, self.segments[self.emit_index]))

    def _advance_emit(self, events: list[StreamEvent]) -> None:
        """Move past finished segments, releasing held audio of the next ones in order."""
        while self.emit_index in self.finished_segments:
            self.finished_segments.discard(self.emit_index)
            self.emit_index += 1
            if self.emit_index >= self.next_to_queue:
                break
            self._announce(events)
            events.extend(AudioChunk(chunk) for chunk in self.held.pop(self.emit_index, []))

    def maybe_complete(self) -> bool:
        """Mark the stream ended once its input is closed and every segment was emitted.

        Returns:
            Whether the stream has ended (for whatever reason).
        """
        if self.input_closed and self.emit_index >= len(self.segments):
            self.ended = True
        return self.ended
