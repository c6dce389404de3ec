"""The engine host's front-end connections (``--frontend-processes N``): one core, several clients.

Each front-end process's :class:`~server.core.client.EngineClient` numbers its streams, voice
requests and adds from its own start, as it does against a core of its own. The hub makes one
core serve them all without any of them knowing:

- **ids**: a command's stream id (or voice request id) is replaced by a host-wide one, and an
  event's host-wide id is turned back into the connection's and sent to that connection only;
- **adds taken**: the core counts the adds it took in all; the hub remembers whose each add
  was, in order (the core takes commands first in, first out) and tells each connection how
  many of *its* adds were taken, so each client's admission sees its own pending adds;
- **late joiners**: ``Loaded``, ``Ready``, the breaker and the last ``Capacity`` are replayed
  to a connection that joins after them (a restarted front-end process);
- **a connection that goes** has its streams cancelled;
- **metrics**: the core's metrics travel to one connection only, the *metrics owner* (the
  oldest front-end connection still open), so ``/metrics``' merged view over the front-end
  processes counts each engine step once. The owner's ``/metrics`` and pace see the engine's
  steps; the others see none of them (their buffer advice is the default one).

A ``Shutdown`` from a front-end connection is ignored: one front end's drain must not stop the
engine the others use. The control connection (the supervisor's, which started the host) stops
it, and its closing ends the host.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from server.core import events as ev
from server.core.engine_core import EngineCore
from server.core.remote.recorder import MetricOps
from server.core.remote.wire import decode_command, encode_events, read_frame

_NO_OPS = MetricOps()


@dataclass(eq=False)
class Peer:
    """One connection to the host: a front-end process, or the supervisor's control connection."""

    writer: asyncio.StreamWriter
    control: bool = False
    #: The connection's stream (or voice request) id → the host-wide one, while it lives.
    streams: dict[int, int] = field(default_factory=dict)
    requests: dict[int, int] = field(default_factory=dict)
    taken: int = 0  # this connection's adds the core has taken in

    def send(self, events: list[ev.CoreEvent], ops: MetricOps = _NO_OPS) -> None:
        """One frame of these events (none when empty), with these metrics."""
        if events and not self.writer.is_closing():
            self.writer.write(encode_events(events, ops))


class Hub:
    """Routes commands from many connections to one core and its events back (the event loop)."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._peers: list[Peer] = []  # in the order they joined: the first front end owns the metrics
        self._ids: Iterator[int] = itertools.count(1)
        self._owner_of_stream: dict[int, tuple[Peer, int]] = {}
        self._owner_of_request: dict[int, tuple[Peer, int]] = {}
        self._adds: deque[Peer] = deque()  # whose each add not yet taken was, in order
        self._taken = 0
        self._replay: dict[type, ev.CoreEvent] = {}  # Loaded, Ready, BreakerChanged, Capacity

    async def serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, control: bool
    ) -> None:
        """Take one connection's commands until it closes; then cancel its streams."""
        peer = Peer(writer, control=control)
        self._peers.append(peer)
        peer.send([self._personal(e, peer) for e in self._replay.values()])
        try:
            while (body := await read_frame(reader)) is not None:
                self._command(peer, decode_command(body))
        finally:
            self._peers.remove(peer)
            for stream_id in list(peer.streams.values()):
                self._core.send(ev.Cancel(stream_id))
                self._owner_of_stream.pop(stream_id, None)

    def _command(self, peer: Peer, command: ev.Command) -> None:
        match command:
            case ev.Add():
                host_id = next(self._ids)
                peer.streams[command.stream_id] = host_id
                self._owner_of_stream[host_id] = (peer, command.stream_id)
                self._adds.append(peer)
                self._core.send(_with_stream(command, host_id))
            case ev.Append() | ev.EndInput() | ev.Cancel():
                if (known := peer.streams.get(command.stream_id)) is not None:
                    self._core.send(_with_stream(command, known))
            case ev.EncodeVoice():
                host_id = next(self._ids)
                peer.requests[command.request_id] = host_id
                self._owner_of_request[host_id] = (peer, command.request_id)
                self._core.send(ev.EncodeVoice(host_id, command.audio, command.transcript))
            case ev.Shutdown():
                if peer.control:  # a front end's drain leaves the shared engine running
                    self._core.shutdown()

    def dispatch(self, events: list[ev.CoreEvent], ops: MetricOps) -> None:
        """One event batch of the core: each event to its connection, or to all; the metrics to one."""
        routed: dict[int, list[ev.CoreEvent]] = {id(p): [] for p in self._peers}
        for event in events:
            match event:
                case ev.SegmentStarted() | ev.Audio() | ev.Ended():
                    owner = self._owner_of_stream.get(event.stream_id)
                    if owner is None:
                        continue  # its connection has gone (its streams were cancelled)
                    peer, stream_id = owner
                    if isinstance(event, ev.Ended):
                        del self._owner_of_stream[event.stream_id]
                        peer.streams.pop(stream_id, None)
                    routed.get(id(peer), []).append(_with_stream(event, stream_id))
                case ev.VoiceEncoded():
                    request = self._owner_of_request.pop(event.request_id, None)
                    if request is not None:
                        peer, request_id = request
                        peer.requests.pop(request_id, None)
                        routed.get(id(peer), []).append(
                            ev.VoiceEncoded(request_id, event.codes, event.message, event.failed)
                        )
                case _:
                    if isinstance(event, ev.Capacity):
                        self._count_taken(event.adds_taken)
                    if isinstance(event, ev.Loaded | ev.Ready | ev.BreakerChanged | ev.Capacity):
                        self._replay[type(event)] = event
                    for peer in self._peers:
                        routed[id(peer)].append(self._personal(event, peer))
        metrics_owner = next((p for p in self._peers if not p.control), None)
        for peer in self._peers:
            peer.send(routed[id(peer)], ops if peer is metrics_owner else _NO_OPS)

    def _count_taken(self, adds_taken: int) -> None:
        """The core has taken ``adds_taken`` adds in all: credit each to its connection."""
        while self._taken < adds_taken and self._adds:
            self._adds.popleft().taken += 1
            self._taken += 1

    @staticmethod
    def _personal(event: ev.CoreEvent, peer: Peer) -> ev.CoreEvent:
        """``Capacity`` counts the adds taken of this connection; other events are everyone's."""
        if isinstance(event, ev.Capacity):
            return ev.Capacity(event.admission, peer.taken)
        return event


_Routed = TypeVar("_Routed")


def _with_stream(value: _Routed, stream_id: int) -> _Routed:
    """The same command or event (one with a ``stream_id``) under another stream id."""
    return cast(_Routed, dataclasses.replace(cast(Any, value), stream_id=stream_id))
