"""The WebSocket port's writes of one event-loop turn go to the socket in one system call.

A stream's pump puts a whole run of items on the wire without waiting in between
(``websockets`` awaits nothing while its transport is not paused), and each message was one
``send`` system call: 12,800 a second for 256 streams of 20 ms frames, the largest single
cost of sending (bench/results/harness/frontend-cost-epyc-2core.md). Here the writes made
in one turn of the event loop are gathered and handed to the transport together, once the
turn's callbacks have run (``loop.call_soon``), so one run of a stream, and the runs of
every stream on the connection that turn, leave in one write. The bytes, their order and
every message are unchanged: this is below the WebSocket framing.

Bounds: what waits here is counted in :meth:`get_write_buffer_size` (so the read
backpressure of :mod:`server.frontends.flow` sees it), and past :data:`FLUSH_BYTES` it is
handed over at once, so the transport's own flow control (``pause_writing``, which
``websockets`` waits on) works as before, one batch late at most. ``close`` and
``write_eof`` hand over what waits first; ``abort`` drops it, as it drops the transport's
own buffer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Final

from server.frontends.flow import FlowTransport

#: Bytes gathered past which they are handed to the transport at once (its high-water mark).
FLUSH_BYTES: Final = 64 * 1024


class CoalescingTransport(FlowTransport):
    """A :class:`FlowTransport` whose writes of one loop turn reach the transport as one write."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__(transport)
        self._pending: list[bytes | bytearray | memoryview[Any]] = []
        self._pending_bytes = 0
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes | bytearray | memoryview[Any]) -> None:
        """Gather ``data``; it leaves with the turn's other writes (or now, past the bound)."""
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= FLUSH_BYTES:
            self._flush()

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview[Any]]) -> None:
        """Gathered as :meth:`write` does."""
        for data in list_of_data:
            self.write(data)

    def _flush(self) -> None:
        """Hand what was gathered to the transport (nothing if it is closing: it would refuse)."""
        if not self._pending:
            return
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        if not self._transport.is_closing():
            self._transport.writelines(pending)

    def get_write_buffer_size(self) -> int:
        """The transport's buffer and what waits here."""
        return self._transport.get_write_buffer_size() + self._pending_bytes

    def write_eof(self) -> None:
        """What waits goes first."""
        self._flush()
        self._transport.write_eof()

    def close(self) -> None:
        """What waits goes first; the transport then closes once its buffer is sent."""
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        """Drop what waits with the transport's own buffer."""
        self._pending, self._pending_bytes = [], 0
        self._transport.abort()
