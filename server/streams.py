"""Streams that outlive their connection: output pipeline, registry by token, TTL.

A :class:`Stream` is what the scheduler feeds: it runs the stream's events
through its encoder into its :class:`~server.session.StreamSession`, whether
or not a connection is attached. Light formats (PCM) are encoded inline on
the event loop; CPU-heavy ones (Opus, Ogg) in a worker thread, one call at
a time per stream (encoders are stateful), so the event loop never waits for
libopus. :class:`StreamRegistry` holds every live stream by its token,
detaches streams whose connection is gone and expires them after the TTL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor

from server.audio import CPU_HEAVY_FORMATS
from server.audio.base import EncodedFrame, FrameEncoder
from server.incremental import TextFeed
from server.scheduler import ScheduledStream
from server.session import BufferOverflow, StreamSession, redact
from server.stream_order import AudioChunk, SegmentStarted, StreamEnded, StreamEvent

log = logging.getLogger(__name__)


class Stream:
    """One stream's output side, independent of any connection."""

    def __init__(
        self,
        session: StreamSession,
        encoder: FrameEncoder,
        *,
        pool: Executor,
        on_overflow: Callable[[Stream], None],
    ) -> None:
        self.session = session
        self.encoder = encoder
        self.handle: ScheduledStream | None = None
        #: Set for ``incremental`` streams: where ``append``/``flush``/``end`` go.
        self.text_feed: TextFeed | None = None
        self._pool = pool if encoder.format in CPU_HEAVY_FORMATS else None
        self._on_overflow = on_overflow
        self._inbox: deque[StreamEvent] = deque()
        self._worker: asyncio.Task[None] | None = None
        self.error_code: str | None = None
        #: ``done`` went out on a live connection; the stream is kept for the TTL only in
        #: case the client lost the connection before it got the last bytes.
        self.delivered = False
        #: Called once when the stream ends ``complete`` (the response cache stores it).
        self.on_complete: Callable[[Stream], None] | None = None

    @property
    def token(self) -> str:
        """The stream's resume token."""
        return self.session.token

    def feed(self, events: list[StreamEvent]) -> None:
        """Scheduler events, on the event loop, in order (the scheduler's sink)."""
        if self._pool is None:
            for event in events:
                self._apply_inline(event)
            return
        self._inbox.extend(events)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain(), name=f"encode-{redact(self.token)}")

    def _apply_inline(self, event: StreamEvent) -> None:
        session = self.session
        if session.ended:
            return
        if isinstance(event, SegmentStarted):
            session.on_segment(event.text)
        elif isinstance(event, AudioChunk):
            self._add(self.encoder.push(event.audio), len(event.audio))
        else:
            self._end(event, self.encoder.finish())

    async def _drain(self) -> None:
        """Encode queued events in a worker thread, one at a time, in order."""
        loop = asyncio.get_running_loop()
        session = self.session
        while self._inbox and not session.ended:
            event = self._inbox.popleft()
            if isinstance(event, SegmentStarted):
                session.on_segment(event.text)
            elif isinstance(event, AudioChunk):
                frames = await loop.run_in_executor(self._pool, self.encoder.push, event.audio)
                self._add(frames, len(event.audio))
            else:
                self._end(event, await loop.run_in_executor(self._pool, self.encoder.finish))
        self._inbox.clear()

    def _add(self, frames: list[EncodedFrame], native_samples: int) -> None:
        try:
            self.session.on_frames(frames, native_samples)
        except BufferOverflow:
            self._on_overflow(self)

    def _end(self, event: StreamEnded, final_frames: list[EncodedFrame]) -> None:
        if event.error is not None:
            self.error_code = event.error.code
        if self.text_feed is not None:
            self.text_feed.close()
        self.session.finish(event.reason, final_frames, event.error)
        if event.reason == "complete" and self.on_complete is not None:
            self.on_complete(self)

    def cancel(self) -> None:
        """Stop generation and end the stream with ``done`` reason ``cancelled``."""
        if self.handle is not None:
            self.handle.cancel()
        if self.text_feed is not None:
            self.text_feed.close()
        self.feed([StreamEnded("cancelled")])

    async def aclose(self) -> None:
        """Stop generation and the encoding worker (the stream is being forgotten)."""
        if self.handle is not None:
            self.handle.cancel()
        if self.text_feed is not None:
            self.text_feed.close()
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)


class StreamRegistry:
    """Every live stream by token; detached ones expire ``ttl_s`` after losing their connection."""

    def __init__(self, *, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._streams: dict[str, Stream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, stream: Stream, owner: object) -> None:
        """Register a new stream, attached to ``owner`` (a connection)."""
        self._streams[stream.token] = stream
        self.attach(stream, owner)

    def get(self, token: str) -> Stream | None:
        """The stream with this token, if it is still held."""
        return self._streams.get(token)

    def remove(self, stream: Stream) -> None:
        """Forget a stream (its ``done`` was delivered, or it expired)."""
        self._streams.pop(stream.token, None)

    def attach(self, stream: Stream, owner: object) -> None:
        """``owner`` now sends this stream's items."""
        stream.session.owner = owner
        stream.session.detached_at = None

    def detach(self, stream: Stream) -> None:
        """The stream lost its connection; its TTL starts now."""
        stream.session.owner = None
        stream.session.detached_at = self._clock()

    def linger(self, stream: Stream) -> None:
        """``done`` was handed to the socket: keep the stream for the TTL, first to go under pressure."""
        stream.delivered = True
        self.detach(stream)

    @property
    def active(self) -> int:
        """Streams not yet delivered (running, being sent, or waiting for a resume)."""
        return sum(1 for s in self._streams.values() if not s.delivered)

    def over_budget(self, max_bytes: int) -> list[Stream]:
        """Delivered streams to drop, oldest first, so all replay buffers fit ``max_bytes``."""
        total = sum(s.session.held_bytes for s in self._streams.values())
        victims = []
        for stream in self._streams.values():  # dicts keep insertion order: oldest first
            if total <= max_bytes:
                break
            if stream.delivered:
                victims.append(stream)
                total -= stream.session.held_bytes
        return victims

    def expired(self) -> list[Stream]:
        """Detached streams whose TTL has passed (the caller closes and removes them)."""
        now = self._clock()
        return [
            s
            for s in self._streams.values()
            if s.session.detached_at is not None and now - s.session.detached_at >= self.ttl_s
        ]

    def all(self) -> list[Stream]:
        """Every held stream."""
        return list(self._streams.values())
