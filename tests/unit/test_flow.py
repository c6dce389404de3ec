"""FlowTransport: the protocol's read pausing and the write side's compose (issue 42, finding 3)."""

from __future__ import annotations

import asyncio

from server.frontends.flow import MAX_UNSENT_BYTES, FlowTransport


class Recorder(asyncio.Transport):
    """A transport that only records whether it reads."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = True
        self.closing = False
        self.unsent = 0

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def is_reading(self) -> bool:
        return self.reading

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        assert self.reading, "paused twice"
        self.reading = False

    def resume_reading(self) -> None:
        assert not self.reading, "resumed twice"
        self.reading = True


def test_reading_stops_only_past_the_unsent_bound() -> None:
    inner = Recorder()
    flow = FlowTransport(inner)
    inner.unsent = MAX_UNSENT_BYTES  # a slow reader's usual backlog: still read
    flow.after_read()
    assert inner.reading
    inner.unsent += 1  # answers written without waiting pile up
    flow.after_read()
    assert not inner.reading
    inner.unsent = 0
    flow.writes_resumed()
    assert inner.reading


def test_neither_side_resumes_what_the_other_paused() -> None:
    inner = Recorder()
    flow = FlowTransport(inner)
    inner.unsent = MAX_UNSENT_BYTES + 1
    flow.pause_reading()  # the library's queue is full
    flow.after_read()
    flow.resume_reading()  # the library drained its queue: the unsent bytes still hold reading
    assert not inner.reading
    flow.writes_resumed()
    assert inner.reading
    flow.after_read()
    flow.pause_reading()
    flow.writes_resumed()  # the writes drained: the library still holds reading
    assert not inner.reading
    flow.resume_reading()
    assert inner.reading


def test_a_closing_transport_is_left_alone() -> None:
    inner = Recorder()
    flow = FlowTransport(inner)
    inner.closing = True
    inner.unsent = MAX_UNSENT_BYTES + 1
    flow.after_read()
    assert inner.reading  # not touched
