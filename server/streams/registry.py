"""Every live stream by its resume token, and which of them the TTL or the replay budget frees."""

from __future__ import annotations

from collections.abc import Callable

from server.streams.budget import MemoryBudget
from server.streams.stream import Stream, StreamState


class StreamRegistry:
    """Streams by token; the service frees what :meth:`expired` and :meth:`over_budget` name."""

    def __init__(self, *, ttl_s: float, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._streams: dict[str, Stream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, stream: Stream) -> None:
        """Register a new stream."""
        self._streams[stream.token] = stream

    def get(self, token: str) -> Stream | None:
        """The stream with this token, if it is still held."""
        return self._streams.get(token)

    def remove(self, stream: Stream) -> None:
        """Forget a stream (it was freed)."""
        self._streams.pop(stream.token, None)

    def all(self) -> list[Stream]:
        """Every held stream, oldest first."""
        return list(self._streams.values())

    def active(self) -> int:
        """Streams not yet counted as ended (running, being sent, or waiting for a resume)."""
        return sum(1 for stream in self._streams.values() if not stream.counted)

    def busy(self) -> int:
        """Streams a drain waits for (still generating, or with items left for a live sender)."""
        return sum(1 for stream in self._streams.values() if stream.busy)

    def expired(self) -> list[Stream]:
        """Streams without a sender for longer than the TTL."""
        deadline = self._clock() - self.ttl_s
        return [
            s for s in self._streams.values() if (since := s.idle_since()) is not None and since <= deadline
        ]

    def budget_victim(self, budget: MemoryBudget) -> Stream | None:
        """The stream to free next for the memory budget (see ``SpeechService.free_over_budget``)."""
        streams = self._streams.values()  # oldest first
        delivered = next((s for s in streams if s.state is StreamState.DELIVERED), None)
        if delivered is not None:
            return delivered
        client = budget.biggest_client()
        return max((s for s in streams if s.client == client), key=lambda s: s.buffered_bytes, default=None)

    def over_budget(self, max_bytes: int) -> list[Stream]:
        """Delivered streams to drop, oldest first, so that all replay buffers fit ``max_bytes``."""
        total = sum(s.outbox.held_bytes for s in self._streams.values())
        victims = []
        for stream in self._streams.values():  # dicts keep insertion order: oldest first
            if total <= max_bytes:
                break
            if stream.state is StreamState.DELIVERED:
                victims.append(stream)
                total -= stream.outbox.held_bytes
        return victims
