"""The policy's waiting sequences in fair order: by priority, then round-robin over clients.

One client with a hundred waiting sequences must not make everyone else wait behind all of
them (issue #25). Each waiting sequence gets a *round* when it is queued: a client's first
waiting sequence is in the round being served now, its second in the next round, and so
on (start-time fair queueing with unit cost). Sequences leave by (priority, round, arrival),
so within a priority the clients take turns, and a client that arrives while another has a
backlog is served in the current round, not after the backlog. With one client this is
plain first-come, first-served. Pure bookkeeping: no clock, no engine.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from server.core.plan import StreamPlan


@dataclass(eq=False)
class Waiting:
    """One segment of a stream waiting for a batch slot since ``since``."""

    plan: StreamPlan
    segment: int
    since: float


class FairQueue:
    """Waiting segments, ordered by (priority, the client's round, arrival)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, Waiting]] = []
        self._order = itertools.count()
        self._served: dict[int, int] = {}  # priority → the round served last
        self._next_round: dict[tuple[int, str], int] = {}  # (priority, client) → its next round
        self._waiting: Counter[tuple[int, str]] = Counter()  # (priority, client) → entries

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Waiting]:
        """The entries in the order they would leave."""
        return (entry for *_, entry in sorted(self._heap, key=lambda item: item[:3]))

    def push(self, priority: int, entry: Waiting) -> None:
        """Queue ``entry``: in its client's next round, never before the round being served."""
        key = (priority, entry.plan.client)
        turn = max(self._next_round.get(key, 0), self._served.get(priority, 0))
        self._next_round[key] = turn + 1
        self._waiting[key] += 1
        heapq.heappush(self._heap, (priority, turn, next(self._order), entry))

    def pop(self) -> Waiting:
        """The next entry to admit (raises ``IndexError`` when empty)."""
        priority, turn, _, entry = heapq.heappop(self._heap)
        self._served[priority] = max(self._served.get(priority, 0), turn)
        self._forget((priority, entry.plan.client))
        return entry

    def remove(self, plan: StreamPlan) -> None:
        """Drop every entry of ``plan`` (its stream ended)."""
        kept = [item for item in self._heap if item[3].plan is not plan]
        if len(kept) == len(self._heap):
            return
        for priority, _, _, entry in self._heap:
            if entry.plan is plan:
                self._forget((priority, plan.client))
        self._heap = kept
        heapq.heapify(self._heap)

    def promote(self, plan: StreamPlan, segment: int) -> None:
        """``plan``'s ``segment``, queued as look-ahead (priority 1), is now the one heard (0)."""
        for index, (priority, _, _, entry) in enumerate(self._heap):
            if priority == 1 and entry.plan is plan and entry.segment == segment:
                self._heap[index] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                self._forget((1, plan.client))
                self.push(0, entry)
                return

    def oldest_since(self) -> float:
        """When the longest-waiting entry was queued (the queue must not be empty)."""
        return min(entry.since for *_, entry in self._heap)

    def count(self, priority: int) -> int:
        """Waiting entries of ``priority``."""
        return sum(n for (p, _), n in self._waiting.items() if p == priority)

    def by_client(self, priority: int = 0) -> dict[str, int]:
        """Waiting entries of ``priority`` per client (clients with none are absent)."""
        return {client: n for (p, client), n in self._waiting.items() if p == priority}

    def _forget(self, key: tuple[int, str]) -> None:
        """One entry of ``key`` left; a client with none waiting starts afresh in the current round."""
        self._waiting[key] -= 1
        if self._waiting[key] <= 0:
            del self._waiting[key]
            del self._next_round[key]
