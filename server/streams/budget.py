"""The memory budget: every byte buffered for clients, in total and per client (issue #25).

What the server holds for its clients is counted here as it changes: each stream's outbox
(replay buffer and unsent audio, :class:`~server.streams.outbox.Outbox`) and the audio
its generation received but has not encoded yet (the encoder's queue,
:class:`~server.core.client.Generation`), each item with an allowance for its Python
objects. Bounds per stream (``--replay-max-bytes``, ``--max-buffered-s``) are not enough:
many streams that nobody reads would add up without end. When the total passes
``--memory-budget-bytes`` the service frees streams until it fits
(:meth:`StreamRegistry.free_for_budget <server.streams.registry.StreamRegistry>`): delivered
ones first, then those of the client that holds the most, its biggest first, so the client
that does not read its audio pays, not the others. Bytes on their way through a socket are
bounded per connection by the front ends' write buffers, not counted here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Final

#: What one buffered item costs besides its payload (the item and bytes objects, the deque slot).
ITEM_OVERHEAD_BYTES: Final = 160
#: What one stream's own objects cost the memory budget while it is held (the stream, its
#: outbox, lease, generation, events and registry entries; its items are charged by the outbox).
#: Measured with tracemalloc over 1000 cancelled streams waiting for a resume (an in-process
#: server on the fake engine, one WebSocket client, opus at 48 kHz): 5.3 KiB each with their
#: few items; rounded up to leave room for a stream with words, text or a voice.
STREAM_OVERHEAD_BYTES: Final = 8 * 1024
#: Bytes per character of pending text an incremental stream is charged (its bound, at UCS-4).
PENDING_CHAR_BYTES: Final = 4


class MemoryBudget:
    """Bytes buffered for clients, by client; calls ``on_over`` (soon, once) when past ``limit``.

    Args:
        limit: the budget in bytes; 0 or less: no budget (nothing is ever freed for it).
        on_over: frees memory; called from the event loop after the charge that passed the
            limit returns, so that a charge never frees streams in the middle of its caller.
    """

    def __init__(self, limit: int, on_over: Callable[[], None]) -> None:
        self.limit = limit
        self.total = 0
        self._by_client: dict[str, int] = {}
        self._on_over = on_over
        self._scheduled = False

    @property
    def over(self) -> bool:
        """More is buffered than the budget allows."""
        return 0 < self.limit < self.total

    def of(self, client: str) -> int:
        """Bytes buffered for ``client``."""
        return self._by_client.get(client, 0)

    def biggest_client(self) -> str | None:
        """The client with the most bytes buffered (None when nothing is)."""
        return max(self._by_client, key=self._by_client.__getitem__, default=None)

    def charger(self, client: str) -> Callable[[int], None]:
        """A function that charges ``client`` a change in bytes (negative: freed)."""
        return partial(self.charge, client)

    def charge(self, client: str, delta: int) -> None:
        """``client``'s buffers grew (or shrank) by ``delta`` bytes."""
        self.total += delta
        left = self._by_client.get(client, 0) + delta
        if left > 0:
            self._by_client[client] = left
        else:
            self._by_client.pop(client, None)
        if self.over and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._run)

    def _run(self) -> None:
        self._scheduled = False
        if self.over:
            self._on_over()


class Held:
    """Things of a known size one stream holds besides its buffers, each charged until dropped.

    Args:
        charge: the client's charger (:meth:`MemoryBudget.charger`); None: not counted.
        sizes: bytes by name (``stream``, ``encoder``, ``text``), charged now.
    """

    __slots__ = ("_charge", "_sizes")

    def __init__(self, charge: Callable[[int], None] | None, **sizes: int) -> None:
        self._charge = charge
        self._sizes = {name: size for name, size in sizes.items() if size}
        if charge is not None and self._sizes:
            charge(sum(self._sizes.values()))

    @property
    def total(self) -> int:
        """Bytes charged now."""
        return sum(self._sizes.values())

    def __contains__(self, name: str) -> bool:
        return name in self._sizes

    def drop(self, name: str) -> None:
        """``name`` was freed: give its bytes back (once)."""
        size = self._sizes.pop(name, 0)
        if size and self._charge is not None:
            self._charge(-size)
