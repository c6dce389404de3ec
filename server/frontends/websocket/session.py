"""One WebSocket connection's protocol, sans I/O: client messages in, server messages and actions out.

:class:`ConnectionProtocol` owns what a connection means: dispatch of each
client message, the slots of its attached streams, ``start``, ``cancel``,
incremental text and ``resume`` with its checks. It answers with
:class:`Send` (a text message), :class:`StartPump`/:class:`StopPump` (a
stream's items start/stop flowing to this connection) and :class:`Close`;
``server.frontends.websocket.connection`` carries them out on a socket. Every message it sends is
built in ``server.frontends.websocket.wire``. Tests drive it with plain strings, no sockets.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from server.audio import opus_preskip
from server.errors import ServiceError, UnknownStream
from server.frontends.access import tenant_of
from server.frontends.common import ServerInfo
from server.frontends.websocket import wire
from server.frontends.websocket.wire import (
    Append,
    Cancel,
    ClientMessage,
    End,
    Flush,
    ProtocolError,
    Resume,
    Start,
)
from server.metrics import Metrics
from server.streams.limits import TokenBucket
from server.streams.outbox import Done, Failure, Frame, OutItem, SegmentMark, Words
from server.streams.service import SpeechService
from server.streams.stream import Lease, Stream


@dataclass(eq=False)
class Attachment:
    """A stream sent on this connection under ``slot``, for as long as ``lease`` holds."""

    stream: Stream
    slot: int
    lease: Lease


@dataclass(frozen=True)
class Send:
    """Send a text message."""

    data: str


@dataclass(frozen=True)
class StartPump:
    """Send ``attachment``'s items from outbox ``index`` on, as they come."""

    attachment: Attachment
    index: int


@dataclass(frozen=True)
class StopPump:
    """Stop sending ``attachment``'s items (before what follows is sent)."""

    attachment: Attachment


@dataclass(frozen=True)
class Close:
    """Close the connection."""

    code: int
    reason: str


Action = Send | StartPump | StopPump | Close
DRAIN_CLOSE = Close(1012, "server is restarting")
#: Past ``--invalid-messages-per-s`` a connection is closed with the policy code.
INVALID_CLOSE = Close(1008, "too many invalid messages")
#: Refusals that are the message's fault, counted against ``--invalid-messages-per-s``; the
#: others (``overloaded``, ``resume_expired``, ``shutting_down``, ``internal``) are the server's.
INVALID_CODES: Final = frozenset(
    {"bad_request", "text_too_long", "unsupported", "duplicate_id", "too_many_streams", "unknown_stream"}
    | {"rate_limited"}  # a client that ignores retry_after_ms
)


class ConnectionProtocol:
    """The state of one connection: its attached streams by the client's id, and their slots.

    Args:
        service: opens, resumes and frees streams.
        info: what ``hello`` advertises.
        client: the client's rate-limit identity (from the access gate).
        route: the ingress's request id, put into new streams' tokens.
        abort: drops the connection at once (a stream's reader fell too far behind).
        metrics: counts the error messages sent, by code.
    """

    def __init__(
        self,
        service: SpeechService,
        info: ServerInfo,
        *,
        client: str,
        route: str | None,
        abort: Callable[[str], None],
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._service = service
        self._info = info
        self._client = client
        #: The tenant this connection's key belongs to (None: no API keys, one user).
        self._owner = tenant_of(client)
        self._route = route
        self._abort = abort
        self._metrics = metrics
        self._clock = clock
        self._attached: dict[str, Attachment] = {}
        rate = service.settings.invalid_messages_per_s
        #: Invalid messages this connection may still send (refilled at ``rate`` per second).
        self._invalid = TokenBucket(rate, rate, rate, clock()) if rate > 0 else None

    def hello(self) -> str:
        """The first message."""
        return wire.hello(self._info, self._service.voice_names(self._owner))

    @property
    def attached(self) -> dict[str, Attachment]:
        """The streams sent here now, by the client's id (streams that moved away are dropped)."""
        for name in [n for n, a in self._attached.items() if a.lease.revoked]:
            del self._attached[name]
        return self._attached

    # --- client messages ----------------------------------------------------------------

    def receive(self, raw: str | bytes) -> list[Action]:
        """One message from the client; returns what to do, in order."""
        try:
            return self._dispatch(wire.parse_client_message(raw, max_depth=self._info.max_json_depth))
        except ProtocolError as err:
            self._metrics.errors.labels(code=err.code).inc()
            actions: list[Action] = [Send(wire.error(err))]
            if err.code == "shutting_down":
                actions += self.close_if_idle()
            elif err.code in INVALID_CODES and self._too_many_invalid():
                self._metrics.errors.labels(code="too_many_invalid").inc()
                actions.append(INVALID_CLOSE)
            return actions

    def _too_many_invalid(self) -> bool:
        """Count one invalid message; True once past ``--invalid-messages-per-s``."""
        return self._invalid is not None and self._invalid.take(self._clock()) > 0

    def _dispatch(self, message: ClientMessage) -> list[Action]:
        if isinstance(message, Start):
            return self._start(message)
        if isinstance(message, Resume):
            return self._resume(message)
        stream = self._live(message.id)
        try:
            if isinstance(message, Cancel):
                stream.cancel()
            else:
                self._text(message, stream)
        except ServiceError as exc:
            raise wire.wire_error(exc, name=message.id) from None
        return []

    def _text(self, message: Append | Flush | End, stream: Stream) -> None:
        feed = stream.text
        if feed is None:
            raise ProtocolError(
                "bad_request", f"stream {message.id!r} was not started with `incremental`", name=message.id
            )
        if isinstance(message, Append):
            feed.append(message.text)
        elif isinstance(message, Flush):
            feed.flush()
        else:
            feed.end()

    def _start(self, msg: Start) -> list[Action]:
        service = self._service
        lease = Lease(self._abort)
        try:
            service.check_accepting()
            self._check_room(msg.id)
            request = wire.speech_request(msg)
            stream = service.open(request, lease, route=self._route, client=self._client, owner=self._owner)
        except ServiceError as exc:
            raise wire.wire_error(exc, name=msg.id) from None
        attachment = self._attach(stream, lease)
        outbox = stream.outbox
        started = wire.started(
            msg.id,
            attachment.slot,
            stream.token,
            stream.encoder.format,
            outbox.sample_rate,
            opus_preskip(stream.encoder),
        )
        return [Send(started), StartPump(attachment, outbox.sent_index)]

    def _resume(self, msg: Resume) -> list[Action]:
        service = self._service
        try:
            stream = service.find(msg.stream, self._owner)
            # Check everything before touching the stream's current attachment.
            stream.outbox.check_resumable(msg.after_seq)
        except ServiceError as exc:
            name = None if isinstance(exc, UnknownStream) else stream.name
            raise wire.wire_error(exc, name=name, token=msg.stream) from None
        mine = self.attached.get(stream.name)
        here = mine is not None and mine.stream is stream
        if not here:
            self._check_room(stream.name)
        actions: list[Action] = []
        if mine is not None and here:
            del self._attached[stream.name]
            actions.append(StopPump(mine))  # the resumed items must not interleave with it
        lease = Lease(self._abort)
        index = service.resume(stream, msg.after_seq, lease)
        attachment = self._attach(stream, lease)
        outbox = stream.outbox
        resumed = wire.resumed(
            stream.name,
            attachment.slot,
            stream.token,
            msg.after_seq,
            stream.encoder.format,
            outbox.sample_rate,
            opus_preskip(stream.encoder),
            None if stream.text is None else stream.text.received,
        )
        return [*actions, Send(resumed), StartPump(attachment, index)]

    def _live(self, name: str) -> Stream:
        attachment = self.attached.get(name)
        if attachment is None:
            raise ProtocolError("bad_request", f"no live stream with id {name!r}", name=name)
        return attachment.stream

    def _check_room(self, name: str) -> None:
        attached = self.attached
        if name in attached:
            raise ProtocolError("duplicate_id", f"stream id {name!r} is already live", name=name)
        if len(attached) >= self._info.max_streams:
            raise ProtocolError(
                "too_many_streams", f"at most {self._info.max_streams} streams per connection", name=name
            )

    def _attach(self, stream: Stream, lease: Lease) -> Attachment:
        used = {a.slot for a in self._attached.values()}
        slot = next(n for n in range(len(used) + 1) if n not in used)
        attachment = Attachment(stream, slot, lease)
        self._attached[stream.name] = attachment
        return attachment

    # --- sending --------------------------------------------------------------------------

    def render(self, attachment: Attachment, item: OutItem) -> str | bytes:
        """An outbox item as the message that carries it on this connection."""
        if isinstance(item, Frame):
            return wire.frame(attachment.slot, item)
        name = attachment.stream.name
        if isinstance(item, SegmentMark):
            return wire.segment(name, attachment.slot, item)
        if isinstance(item, Words):
            return wire.words(name, attachment.slot, item)
        if isinstance(item, Failure):
            err = wire.wire_error(item.error, name=name)
            self._metrics.errors.labels(code=err.code).inc()
            return wire.error(err)
        assert isinstance(item, Done)
        return wire.done(name, attachment.slot, item)

    def pump_ended(self, attachment: Attachment) -> list[Action]:
        """``attachment``'s items stopped flowing (``done`` went out, or the stream moved)."""
        if self._attached.get(attachment.stream.name) is attachment:
            del self._attached[attachment.stream.name]
        return self.close_if_idle()

    def close_if_idle(self) -> list[Action]:
        """During a drain, a connection with no streams left is closed with 1012."""
        return [DRAIN_CLOSE] if self._service.draining and not self.attached else []

    def connection_lost(self) -> None:
        """The connection is gone: its streams wait for a resume (or are freed, TTL 0)."""
        for attachment in self._attached.values():
            attachment.stream.detach(attachment.lease)
        self._attached.clear()
