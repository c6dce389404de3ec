"""CoalescingTransport: the WebSocket port's writes of one loop turn reach the socket as one write."""

from __future__ import annotations

import asyncio

from server.frontends.flow import MAX_UNSENT_BYTES
from server.frontends.websocket.coalesce import FLUSH_BYTES, CoalescingTransport


class Socket(asyncio.Transport):
    """A transport that records every write call and what ended it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[bytes]] = []
        self.events: list[str] = []
        self.closing = False
        self.reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:  # type: ignore[override]
        self.calls.append([bytes(data)])

    def writelines(self, list_of_data: object) -> None:  # type: ignore[override]
        self.calls.append([bytes(d) for d in list_of_data])  # type: ignore[attr-defined]

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self.closing

    def is_reading(self) -> bool:
        return self.reading

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def close(self) -> None:
        self.events.append("close")
        self.closing = True

    def abort(self) -> None:
        self.events.append("abort")
        self.closing = True

    def write_eof(self) -> None:
        self.events.append("eof")


async def next_turn() -> None:
    """Let the loop run the callbacks scheduled in this turn (the flush among them)."""
    await asyncio.sleep(0)


async def test_the_writes_of_one_turn_leave_in_order_in_one_write() -> None:
    socket = Socket()
    transport = CoalescingTransport(socket)
    for i in range(20):
        transport.write(b"frame %d;" % i)
    transport.write(b"")  # nothing to send is not a write
    assert socket.calls == []
    assert transport.get_write_buffer_size() == sum(len(b"frame %d;" % i) for i in range(20))
    await next_turn()
    assert socket.calls == [[b"frame %d;" % i for i in range(20)]]
    assert transport.get_write_buffer_size() == 0
    transport.writelines([b"a", b"b"])
    await next_turn()
    assert socket.calls[1:] == [[b"a", b"b"]]


async def test_past_the_bound_what_waits_is_handed_over_at_once() -> None:
    socket = Socket()
    transport = CoalescingTransport(socket)
    transport.write(b"x" * (FLUSH_BYTES - 1))
    assert socket.calls == []
    transport.write(b"y")  # reaches the bound: the transport's own flow control sees it now
    assert socket.calls == [[b"x" * (FLUSH_BYTES - 1), b"y"]]
    assert transport.get_write_buffer_size() == 0
    await next_turn()  # the turn's scheduled flush finds nothing left
    assert len(socket.calls) == 1


async def test_close_and_eof_send_what_waits_first_and_abort_drops_it() -> None:
    socket = Socket()
    transport = CoalescingTransport(socket)
    transport.write(b"goodbye")
    transport.write_eof()
    assert socket.calls == [[b"goodbye"]] and socket.events == ["eof"]
    transport.write(b"close frame")
    transport.close()
    assert socket.calls[-1] == [b"close frame"] and socket.events == ["eof", "close"]
    dropped = Socket()
    transport = CoalescingTransport(dropped)
    transport.write(b"never sent")
    transport.abort()
    await next_turn()
    assert dropped.calls == [] and dropped.events == ["abort"]
    assert transport.get_write_buffer_size() == 0


async def test_a_closing_transport_is_handed_nothing() -> None:
    socket = Socket()
    transport = CoalescingTransport(socket)
    transport.write(b"late")
    socket.closing = True  # the peer went away before the turn ended
    await next_turn()
    assert socket.calls == []


async def test_what_waits_counts_toward_the_read_backpressure() -> None:
    socket = Socket()
    socket.get_write_buffer_size = lambda: MAX_UNSENT_BYTES  # type: ignore[method-assign]
    transport = CoalescingTransport(socket)
    transport.after_read()
    assert socket.reading  # at the bound: still read
    transport.write(b"!")  # one byte more waits here, not yet in the transport's buffer
    transport.after_read()
    assert not socket.reading  # past it: not read until the writes drain
