"""One stream as the event loop sees it: the request, and its events as they arrive.

:class:`Generation` is what :meth:`EngineClient.generate <server.core.client.EngineClient.generate>`
returns: an async iterator of the stream's events that counts the audio it holds but nobody
has read (the memory budget), and steers its stream through the client.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from server.core.events import Audio, Ended, StreamEvent
from server.engine_api import SynthesisParams


class StreamControl(Protocol):
    """What a generation asks of its client (:class:`~server.core.client.EngineClient`)."""

    def append(self, stream_id: int, text: str) -> None:
        """One more segment for an incremental stream."""

    def end_input(self, stream_id: int) -> None:
        """No more segments for it."""

    def abort(self, stream_id: int) -> None:
        """Stop generating it."""


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One stream to synthesize.

    Attributes:
        segments: the text, already split into segments (sentences).
        params: voice and sampling parameters.
        incremental: more segments will come through ``append`` until ``end_input``.
        client: who asks (its rate-limit identity): admission and the queue are fair by client.
        on_queued: told the change in bytes of audio received but not yet read from the
            generation (a memory budget counts it).
        first_segment: the stream's index of ``segments[0]``: a stream regenerated from its
            k-th segment on (a resume on another replica) draws each segment's random numbers
            as the whole stream did (seed offset ``first_segment + i``).
    """

    segments: tuple[str, ...]
    params: SynthesisParams
    incremental: bool = False
    client: str = ""
    on_queued: Callable[[int], None] | None = None
    first_segment: int = 0


#: What one queued ``Audio`` event costs besides its samples (the event and array objects).
EVENT_OVERHEAD_BYTES = 200


class Generation:
    """One stream's events, in order: iterate it with ``async for``; it ends after ``Ended``."""

    __slots__ = ("_client", "_ended", "_events", "_on_queued", "_waiter", "queued_bytes", "stream_id")

    def __init__(
        self, client: StreamControl, stream_id: int, on_queued: Callable[[int], None] | None = None
    ) -> None:
        self._client = client
        self.stream_id = stream_id
        self._events: deque[StreamEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._on_queued = on_queued
        #: Bytes of the audio events received and not yet read.
        self.queued_bytes = 0

    def append(self, text: str) -> None:
        """One more segment (incremental streams)."""
        self._client.append(self.stream_id, text)

    def end_input(self) -> None:
        """No more segments: the stream ends after those it has."""
        self._client.end_input(self.stream_id)

    def abort(self) -> None:
        """Stop generating; ``Ended`` with reason ``cancelled`` follows unless it ended already."""
        self._client.abort(self.stream_id)

    def discard(self) -> None:
        """Nobody will read on: stop generating and drop the events not read yet."""
        self.abort()
        self._events.clear()
        self._ended = True
        self._count(-self.queued_bytes)

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> StreamEvent:
        events = self._events
        while not events:
            if self._ended:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        event = events.popleft()
        if isinstance(event, Audio):
            self._count(-(event.samples.nbytes + EVENT_OVERHEAD_BYTES))
        return event

    def _count(self, delta: int) -> None:
        if delta:
            self.queued_bytes += delta
            if self._on_queued is not None:
                self._on_queued(delta)

    def _push(self, event: StreamEvent) -> None:
        self._events.append(event)
        if isinstance(event, Audio):
            self._count(event.samples.nbytes + EVENT_OVERHEAD_BYTES)
        if isinstance(event, Ended):
            self._ended = True
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)
