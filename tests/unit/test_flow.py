"""FlowTransport: the protocol's read pausing and the write side's compose (issue 42, finding 3)."""

from __future__ import annotations

import asyncio

from server.frontends.flow import FlowTransport


class Recorder(asyncio.Transport):
    """A transport that only records whether it reads."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = True
        self.closing = False

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


def test_neither_side_resumes_what_the_other_paused() -> None:
    inner = Recorder()
    flow = FlowTransport(inner)
    flow.pause_reading()  # the library's queue is full
    flow.writes_paused()
    flow.resume_reading()  # the library drained its queue: writes still paused
    assert not inner.reading
    flow.writes_resumed()
    assert inner.reading
    flow.writes_paused()
    flow.pause_reading()
    flow.writes_resumed()  # the writes drained: the library still holds reading
    assert not inner.reading
    flow.resume_reading()
    assert inner.reading


def test_a_closing_transport_is_left_alone() -> None:
    inner = Recorder()
    flow = FlowTransport(inner)
    inner.closing = True
    flow.writes_paused()
    assert inner.reading  # not touched
