"""Every live stream by its resume token; which of them the TTL, the caps, the replay or memory budget free.

Ended streams kept only for a resume (delivered ones, and detached ones whose generation
ended: :attr:`Stream.lingering <server.streams.stream.Stream.lingering>`) are capped per
client (``--max-ended-streams-per-client``) and in all (``--max-ended-streams``): past a cap
the one that ended longest ago is freed. Without the caps a client that starts and cancels
streams in a loop keeps a resume TTL's worth of them (issue #42).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from server.config import Settings
from server.streams.budget import MemoryBudget
from server.streams.lifecycle import StreamState
from server.streams.stream import Stream


class StreamRegistry:
    """Streams by token; the service frees what :meth:`expired` and :meth:`over_budget` name."""

    def __init__(
        self,
        *,
        ttl_s: float,
        clock: Callable[[], float],
        max_ended: int | None = None,
        max_ended_per_client: int | None = None,
    ) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._streams: dict[str, Stream] = {}
        #: The caps on ended streams kept for a resume (None: no cap).
        self.max_ended = None if max_ended is None else max(0, max_ended)
        self.max_ended_per_client = None if max_ended_per_client is None else max(0, max_ended_per_client)
        #: Ended streams kept for a resume, in the order they ended: in all and by client.
        self._ended: OrderedDict[str, Stream] = OrderedDict()
        self._ended_by_client: dict[str, OrderedDict[str, Stream]] = {}

    @classmethod
    def for_settings(cls, settings: Settings, clock: Callable[[], float]) -> StreamRegistry:
        """The registry ``settings`` ask for (``--resume-ttl-s``, the caps on ended streams)."""
        return cls(
            ttl_s=settings.resume_ttl_s,
            clock=clock,
            max_ended=settings.max_ended_streams,
            max_ended_per_client=settings.max_ended_streams_per_client,
        )

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
        self._forget_ended(stream)

    def ended(self, client: str | None = None) -> list[Stream]:
        """Ended streams kept for a resume (of ``client``, or all), the one that ended first first."""
        kept = self._ended if client is None else self._ended_by_client.get(client)
        return [] if kept is None else list(kept.values())

    def linger(self, stream: Stream) -> None:
        """``stream`` may have ended or been resumed: keep it in line, then free what the caps exceed."""
        if stream.token not in self._streams:
            return
        self._forget_ended(stream)
        if not stream.lingering:
            return
        self._ended[stream.token] = stream  # the newest: freed last
        mine = self._ended_by_client.setdefault(stream.client, OrderedDict())
        mine[stream.token] = stream
        for kept, cap in ((mine, self.max_ended_per_client), (self._ended, self.max_ended)):
            while cap is not None and len(kept) > cap:
                _free_kept(next(iter(kept.values())))

    def _forget_ended(self, stream: Stream) -> None:
        if self._ended.pop(stream.token, None) is None:
            return
        mine = self._ended_by_client[stream.client]
        del mine[stream.token]
        if not mine:
            del self._ended_by_client[stream.client]

    def all(self) -> list[Stream]:
        """Every held stream, oldest first."""
        return list(self._streams.values())

    def active(self) -> int:
        """Streams not yet counted as ended (running, being sent, or waiting for a resume)."""
        return sum(1 for stream in self._streams.values() if not stream.counted)

    def generating(self) -> int:
        """Streams still generating (each holds or waits for an engine row)."""
        return sum(1 for stream in self._streams.values() if stream.generating)

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
            _free_kept(stream)
        for stream in self.over_budget(replay_total_bytes):
            stream.close()

    def free_for_budget(self, budget: MemoryBudget) -> list[Stream]:
        """Free streams until ``budget`` is kept again; returns those freed.

        Ended streams kept only for a resume go first, the one that ended first first; then
        the streams of the client that holds the most, its biggest first. A freed stream's
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
        ended = next(iter(self._ended.values()), None)
        if ended is not None:
            return ended
        client = budget.biggest_client()
        streams = self._streams.values()
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


def _free_kept(stream: Stream) -> None:
    """Free a stream nobody sends: a detached one expires (counted so), a delivered one closes."""
    if stream.state is StreamState.DETACHED:
        stream.expire()
    else:
        stream.close()
