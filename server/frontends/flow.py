"""Read backpressure on every port: a peer that does not read what it is sent is not read either.

A peer that sends but never reads must not make the server buffer without bound. Some replies
are written by the libraries themselves, with no regard for the write buffer: ``websockets``
answers every ping from ``data_received``, so a flood of pings whose pongs are never read
grew the transport's write buffer by all that the peer sent (400 MB of pings, 730 MB of RSS
on one connection). So once a read leaves more than :data:`MAX_UNSENT_BYTES` unsent for the
peer, the connection is not read until its writes drain below the transport's low-water
mark: the flood waits in the kernel's socket buffers and on the sender, whatever the library
answers, for every front end behind the port guards
(:class:`~server.frontends.ports.GuardedProtocol` and the WebSocket port's connection class).

The bound is well above the write buffer's high-water mark (32-64 KiB), which the front
ends' own writes never pass by more than one message since each awaits its drain: a client
that reads slowly is not held back by it, and its close handshake and messages are read as
before; only replies written without waiting reach it.

The protocol inside (``websockets``' connection, aiohttp's handler, asyncio streams) pauses
and resumes reading for reasons of its own too (a full message queue). So it is given a
:class:`FlowTransport` instead of the transport: reading runs only while neither it nor the
unsent bytes hold it, and one never resumes what the other paused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Final

#: Unsent bytes for one peer past which it is not read until they drain (see the module's text).
MAX_UNSENT_BYTES: Final = 1024 * 1024


class FlowTransport(asyncio.Transport):
    """``transport`` as a protocol sees it: reading is off while the protocol or the unsent bytes hold it.

    Everything else is passed on. The port's protocol calls :meth:`after_read` after each
    ``data_received`` and :meth:`writes_resumed` from its ``resume_writing``.
    """

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__()
        self._transport = transport
        self._protocol_holds = False  # the protocol called pause_reading
        self._writes_hold = False  # a read left more than MAX_UNSENT_BYTES unsent

    # --- the two holds ------------------------------------------------------------------

    def after_read(self) -> None:
        """What was read has been handled: past :data:`MAX_UNSENT_BYTES` unsent, stop reading."""
        if not self._writes_hold and self.get_write_buffer_size() > MAX_UNSENT_BYTES:
            self._writes_hold = True
            self._apply()

    def writes_resumed(self) -> None:
        """The writes drained to the low-water mark: read again, unless the protocol holds reading."""
        self._writes_hold = False
        self._apply()

    def pause_reading(self) -> None:
        """The protocol's own pause (its queue is full)."""
        self._protocol_holds = True
        self._apply()

    def resume_reading(self) -> None:
        """The protocol's own resume; reading stays off while writes are paused."""
        self._protocol_holds = False
        self._apply()

    def is_reading(self) -> bool:
        """Whether the transport reads now."""
        return self._transport.is_reading()

    def _apply(self) -> None:
        if self._transport.is_closing():
            return  # nothing more is read; a closing transport may refuse the call
        held = self._protocol_holds or self._writes_hold
        if held and self._transport.is_reading():
            self._transport.pause_reading()
        elif not held and not self._transport.is_reading():
            self._transport.resume_reading()

    # --- passed on ----------------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """The transport's."""
        return self._transport.get_extra_info(name, default)

    def is_closing(self) -> bool:
        """The transport's."""
        return self._transport.is_closing()

    def close(self) -> None:
        """The transport's."""
        self._transport.close()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        """The transport's."""
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        """The transport's."""
        return self._transport.get_protocol()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        """The transport's."""
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        """The transport's."""
        return self._transport.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        """The transport's."""
        return self._transport.get_write_buffer_limits()

    def write(self, data: bytes | bytearray | memoryview[Any]) -> None:
        """The transport's."""
        self._transport.write(data)

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview[Any]]) -> None:
        """The transport's."""
        self._transport.writelines(list_of_data)

    def write_eof(self) -> None:
        """The transport's."""
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        """The transport's."""
        return self._transport.can_write_eof()

    def abort(self) -> None:
        """The transport's."""
        self._transport.abort()
