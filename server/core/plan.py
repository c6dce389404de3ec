"""One stream as the scheduling policy sees it: its segments, their order, its events.

Pure bookkeeping (no engine, no clock, no locks): which segments to queue
next (look-ahead), and how step results become the stream's events in order.
Audio of the segment being heard goes out at once; audio of look-ahead
segments is held until the segments before it have finished. The plan also
keeps how far the audio it let out is ahead of real time (its *lead*), which
decides when its look-ahead may take part in a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from server.core.events import Audio, SegmentStarted, StreamEvent
from server.engine_api import NATIVE_SAMPLE_RATE, AudioArray, SynthesisParams


@dataclass(eq=False)
class StreamPlan:
    """The loop-side record of one stream.

    Attributes:
        stream_id: the engine client's id of the stream.
        params: voice and sampling parameters of every segment.
        segments: the segment texts so far (incremental streams grow).
        input_closed: no more segments will be appended.
        next_to_queue: index of the next segment to queue.
        emit_index: the segment whose audio goes out now.
        announced: highest segment index whose ``SegmentStarted`` went out.
        held: audio of look-ahead segments, waiting for their turn.
        finished_segments: segments that finished, at or after ``emit_index``.
        live_seqs: engine sequence id → segment index, for segments queued or running.
        ended: no more events follow (complete, cancelled or failed).
        client: who asked for it (its rate-limit identity): the queue takes turns by client.
        first_segment: the stream's index of ``segments[0]``, added to each segment's seed offset
            (a stream regenerated from a later segment draws as the whole stream did).
        heard_since: when its first audio went out (``None``: none yet).
        heard_samples: samples of audio that went out.
    """

    stream_id: int
    params: SynthesisParams
    segments: list[str] = field(default_factory=list)
    input_closed: bool = True
    next_to_queue: int = 0
    emit_index: int = 0
    announced: int = -1
    held: dict[int, list[AudioArray]] = field(default_factory=dict)
    finished_segments: set[int] = field(default_factory=set)
    live_seqs: dict[int, int] = field(default_factory=dict)
    ended: bool = False
    client: str = ""
    first_segment: int = 0
    heard_since: float | None = None
    heard_samples: int = 0

    def lead_s(self, now: float) -> float:
        """Seconds of audio out beyond what a listener who began at its first sample has played.

        ``-inf`` before the first audio: a stream that has not been heard yet has no lead.
        """
        if self.heard_since is None:
            return float("-inf")
        return self.heard_samples / NATIVE_SAMPLE_RATE - (now - self.heard_since)

    def count_heard(self, events: list[StreamEvent], now: float) -> None:
        """Add the audio of ``events`` (this plan's, about to go out) to what was heard."""
        samples = sum(len(e.samples) for e in events if isinstance(e, Audio))
        if samples and self.heard_since is None:
            self.heard_since = now
        self.heard_samples += samples

    def is_lookahead(self, seq_id: int) -> bool:
        """Whether live ``seq_id`` runs one of the stream's look-ahead segments (not the one heard)."""
        return self.live_seqs[seq_id] != self.emit_index

    def held_samples(self, seq_id: int) -> int:
        """Samples of live ``seq_id``'s audio held back so far (what yielding its place would discard)."""
        return sum(len(chunk) for chunk in self.held.get(self.live_seqs[seq_id], ()))

    def give_up(self, seq_id: int) -> int:
        """Look-ahead ``seq_id`` gives up its batch place: forget its run and held audio; its segment.

        The segment stays unfinished and queued (``next_to_queue`` does not move back), so it is
        generated again from its start when it gets a place again; nobody heard its audio.
        """
        segment = self.live_seqs.pop(seq_id)
        self.held.pop(segment, None)
        return segment

    def segments_to_queue(self, lookahead: int) -> list[int]:
        """Segments to queue now, so that at most ``1 + lookahead`` are unfinished.

        Segments that finished ahead of their turn (held audio) do not count, so a
        short segment never stalls the pipeline; but no more are queued while more
        than ``1 + lookahead`` finished segments are held, which bounds the audio a
        stream holds back.
        """
        width = 1 + lookahead
        held = len(self.finished_segments)
        unfinished = self.next_to_queue - self.emit_index - held
        queued = []
        while (
            not self.ended
            and self.next_to_queue < len(self.segments)
            and unfinished < width  # the per-stream share of the batch
            and held <= width  # the held-segment cap
        ):
            queued.append(self.next_to_queue)
            self.next_to_queue += 1
            unfinished += 1
        return queued

    def on_audio(self, segment: int, audio: AudioArray, finished: bool) -> list[StreamEvent]:
        """A step's output for ``segment``: the events it releases, in order."""
        events: list[StreamEvent] = []
        if segment == self.emit_index:
            self._announce(events)
            if len(audio) or finished:  # a segment's end is said even when its last block is empty
                events.append(Audio(self.stream_id, audio, segment_end=finished))
        elif len(audio):
            self.held.setdefault(segment, []).append(audio)
        if finished:
            self.finished_segments.add(segment)
            self._advance_emit(events)
        return events

    def _announce(self, events: list[StreamEvent]) -> None:
        if self.announced < self.emit_index:
            self.announced = self.emit_index
            events.append(SegmentStarted(self.stream_id, self.emit_index, self.segments[self.emit_index]))

    def _advance_emit(self, events: list[StreamEvent]) -> None:
        """Move past finished segments, releasing held audio of the next ones in order."""
        while self.emit_index in self.finished_segments:
            self.finished_segments.discard(self.emit_index)
            self.emit_index += 1
            if self.emit_index >= self.next_to_queue:
                break
            self._announce(events)
            chunks = self.held.pop(self.emit_index, [])
            events.extend(Audio(self.stream_id, chunk) for chunk in chunks[:-1])
            ended = self.emit_index in self.finished_segments  # it finished while held
            if chunks or ended:
                last = chunks[-1] if chunks else np.zeros(0, dtype=np.float32)
                events.append(Audio(self.stream_id, last, segment_end=ended))

    @property
    def complete(self) -> bool:
        """Input closed and every segment emitted: the stream is done."""
        return self.input_closed and self.emit_index >= len(self.segments)
