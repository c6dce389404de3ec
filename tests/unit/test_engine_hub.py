"""The engine host's hub (``--frontend-processes N``): each connection's ids, adds, replays, metrics.

Real connections (Unix socket pairs carrying the real wire); the core is a recorder of the
commands the hub hands it (the hub's rules are about routing, not about what the core does).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import numpy as np

from server.core import events as ev
from server.core.engine_core import EngineCore
from server.core.remote.hub import Hub
from server.core.remote.recorder import MetricOps
from server.core.remote.wire import decode_events, encode_command, read_frame
from server.engine_api import EngineInfo, SynthesisParams

DEADLINE_S = 5.0


class RecordingCore:
    """What the hub needs of a core: it takes commands and can be told to stop."""

    def __init__(self) -> None:
        self.commands: list[ev.Command] = []
        self.stopped = False

    def send(self, command: ev.Command) -> None:
        self.commands.append(command)

    def shutdown(self) -> None:
        self.stopped = True


class Front:
    """A front end's side of one connection to the hub."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def send(self, command: ev.Command) -> None:
        self.writer.write(encode_command(command))

    async def batch(self) -> tuple[list[ev.CoreEvent], MetricOps]:
        async with asyncio.timeout(DEADLINE_S):
            body = await read_frame(self.reader)
        assert body is not None, "the hub closed the connection"
        return decode_events(body)


@asynccontextmanager
async def connected(hub: Hub, *, control: bool = False) -> AsyncIterator[Front]:
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=theirs)
    served = asyncio.create_task(hub.serve(reader, writer, control=control))
    front = Front(*await asyncio.open_unix_connection(sock=ours))
    try:
        yield front
    finally:
        front.writer.close()
        async with asyncio.timeout(DEADLINE_S):
            await served
        writer.close()


async def until(predicate: Any) -> None:
    async with asyncio.timeout(DEADLINE_S):
        while not predicate():
            await asyncio.sleep(0.005)


def add(stream_id: int) -> ev.Add:
    return ev.Add(stream_id, ("hello",), SynthesisParams(seed=1))


def capacity(taken: int) -> ev.Capacity:
    return ev.Capacity(ev.Admission(0, 16, 0.01, False), taken)


async def test_each_connection_keeps_its_ids_its_adds_taken_and_its_events() -> None:
    core = RecordingCore()
    hub = Hub(cast(EngineCore, core))
    async with connected(hub) as one, connected(hub) as two:
        one.send(add(1))
        two.send(add(1))  # the same id on another connection: another stream
        await until(lambda: len(core.commands) == 2)
        first, second = cast(list[ev.Add], core.commands)
        assert first.stream_id != second.stream_id
        samples = np.ones(4, dtype=np.float32)
        ops = MetricOps(observed=(("block_time", 0.01),))
        hub.dispatch([ev.Audio(second.stream_id, samples), capacity(1)], ops)
        events, got_ops = await one.batch()  # the first front end: the metrics, no audio of the other's
        assert events == [capacity(1)] and got_ops == ops
        events, got_ops = await two.batch()
        assert isinstance(events[0], ev.Audio) and events[0].stream_id == 1
        assert events[1] == capacity(0) and got_ops == MetricOps()  # its add is not taken yet
        two.send(ev.Cancel(1))
        await until(lambda: len(core.commands) == 3)
        assert core.commands[2] == ev.Cancel(second.stream_id)


async def test_a_late_joiner_hears_loaded_ready_and_capacity_and_a_leaver_s_streams_are_cancelled() -> None:
    core = RecordingCore()
    hub = Hub(cast(EngineCore, core))
    async with connected(hub) as one:
        one.send(add(7))
        await until(lambda: len(core.commands) == 1)
        hub.dispatch([ev.Loaded(EngineInfo(name="fake")), ev.Ready(), capacity(1)], MetricOps())
        await one.batch()
        async with connected(hub) as late:
            events, _ = await late.batch()
            assert events == [ev.Loaded(EngineInfo(name="fake")), ev.Ready(), capacity(0)]
    (added,) = [c for c in core.commands if isinstance(c, ev.Add)]
    await until(lambda: ev.Cancel(added.stream_id) in core.commands)


async def test_only_the_control_connection_stops_the_engine() -> None:
    core = RecordingCore()
    hub = Hub(cast(EngineCore, core))
    async with connected(hub) as front, connected(hub, control=True) as control:
        front.send(ev.Shutdown())  # a front end's drain
        front.send(add(1))
        await until(lambda: len(core.commands) == 1)
        assert not core.stopped
        control.send(ev.Shutdown())
        await until(lambda: core.stopped)


async def test_a_voice_request_is_answered_on_the_connection_that_asked() -> None:
    core = RecordingCore()
    hub = Hub(cast(EngineCore, core))
    audio = np.zeros(8, dtype=np.float32)
    async with connected(hub) as one, connected(hub) as two:
        one.send(ev.EncodeVoice(1, audio, "one"))
        two.send(ev.EncodeVoice(1, audio, "two"))  # the same request id on another connection
        await until(lambda: len(core.commands) == 2)
        asked = {c.transcript: c.request_id for c in cast(list[ev.EncodeVoice], core.commands)}
        assert asked["one"] != asked["two"]
        hub.dispatch([ev.VoiceEncoded(asked["two"], None, "too short")], MetricOps())
        (answer,), _ = await two.batch()
        assert isinstance(answer, ev.VoiceEncoded)  # (compared by its fields: it holds an array)
        assert (answer.request_id, answer.codes, answer.message) == (1, None, "too short")
