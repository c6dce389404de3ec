"""Every live stream by its resume token, and which of them the TTL, the replay or the memory budget frees."""

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

    def sweep(self, replay_total_bytes: int) -> None:
        """Free every stream whose TTL has passed, then delivered ones over the replay budget."""
        for stream in self.expired():
            if stream.state is StreamState.DETACHED:
                stream.expire()
            else:
                stream.close()
        for stream in self.over_budget(replay_total_bytes):
            stream.close()

    def free_for_budget(self, budget: MemoryBudget) -> list[Stream]:
        """Free streams until ``budget`` is kept again; returns those freed.

        Delivered streams (kept only for a late resume) go first, oldest first; then the
        streams of the client that holds the most, its biggest first. A freed stream's
        connection, if it has one, is aborted (its client was not reading fast enough: the
        same answer as ``--max-buffered-s``); its token then answers ``unknown_stream``.
        """
        freed = []
        while budget.over and (victim := self.budget_victim(budget)) is not None:
            if victim.lease is not None:
                victim.lease.abort("over the server's memory budget: the client holds the most unsent audio")
            victim.close("budget")
            freed.append(victim)
        return freed

    def budget_victim(self, budget: MemoryBudget) -> Stream | None:
        """The stream to free next for the memory budget (:meth:`free_for_budget`)."""
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
