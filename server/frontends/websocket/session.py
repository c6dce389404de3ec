"""One WebSocket connection's protocol, sans I/O: client messages in, server messages and actions out.

:class:`ConnectionProtocol` owns what a connection means: dispatch of each
client message, the slots of its attached streams, ``start``, ``cancel``,
incremental text and ``resume`` with its checks. It answers with
:class:`Send` (a text message), :class:`StartPump`/:class:`StopPump` (a
stream's items start/stop flowing to this connection) and :class:`Close`;
``server.frontends.websocket.connection`` carries them out on a socket. Every message it sends is
built in ``server.frontends.websocket.wire``. Tests drive it with plain strings, no sockets.

A resume of a stream held elsewhere (signed tokens, ``server.streams.routing``) becomes a
:class:`Forward` to its owner (relayed back by ``forward.py``), or, when the owner is gone and
the client sent the stream's request, a regeneration here (``server.streams.failover``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import msgspec

from server.errors import ServiceError, UnknownStream
from server.frontends.access import tenant_of
from server.frontends.common import ServerInfo
from server.frontends.messages import InvalidBudget
from server.frontends.websocket import wire
from server.frontends.websocket.actions import (
    DRAIN_CLOSE,
    INVALID_CLOSE,
    Action,
    Attachment,
    Close,
    Forward,
    Relay,
    Send,
    StartPump,
    StopForward,
    StopPump,
)
from server.frontends.websocket.handoff import Finished, Lost, Outcome, PassOn, Refused, Remote, Unreachable
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
from server.streams.failover import ResumePoint
from server.streams.items import Done, Failure, Frame, OutItem, SegmentMark, Words
from server.streams.lifecycle import Lease
from server.streams.service import SpeechService
from server.streams.stream import Stream
from server.streams.tokens import redact

log = logging.getLogger(__name__)


def _audio_of(stream: Stream) -> tuple[str, str, int, int]:
    """What ``started`` and ``resumed`` tell of a stream: token, format, sample rate, Opus preskip."""
    return stream.token, stream.format, stream.sample_rate, stream.preskip


class ConnectionProtocol:
    """The state of one connection: its attached streams by the client's id, and their slots.

    Args:
        service: opens, resumes and frees streams.
        info: what ``hello`` advertises.
        client: the client's rate-limit identity (from the access gate).
        route: the ingress's request id, put into new streams' tokens.
        abort: drops the connection at once (a stream's reader fell too far behind).
        metrics: counts the error messages sent, by code.
        forwarded: another replica forwards its client's resume here (proven with the shared
            key): this connection never forwards or regenerates, and closes once its stream is
            done or moved.
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
        forwarded: bool = False,
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
        self._forwarded = forwarded
        self._attached: dict[str, Attachment] = {}
        self._remote: dict[str, Remote] = {}  # streams relayed from their owner, by token
        #: Ids whose ``done`` went out last: a ``cancel`` racing that ``done`` is not an error.
        self._ended: deque[str] = deque(maxlen=max(1, info.max_streams))
        #: Invalid messages this connection may still send (``--invalid-messages-per-s``).
        self._invalid = InvalidBudget(service.settings.invalid_messages_per_s, clock)

    def hello(self) -> str:
        """The first message."""
        service = self._service
        # for one more stream now, beside those this front end is generating
        advice = service.pace.advice(joining=True, open_streams=service.registry.generating())
        return wire.hello(self._info, service.catalog.names(self._owner), advice)

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
            elif self._invalid.spend(err.code):
                self._metrics.errors.labels(code="too_many_invalid").inc()
                actions.append(INVALID_CLOSE)
            return actions

    def _dispatch(self, message: ClientMessage) -> list[Action]:
        if isinstance(message, Start):
            return self._start(message)
        if isinstance(message, Resume):
            return self._resume(message)
        remote = next((r for r in self._remote.values() if r.name == message.id), None)
        if remote is not None:  # its owner takes it (cancel, text)
            return [Relay(remote, msgspec.json.encode(message).decode())]
        if isinstance(message, Cancel) and message.id not in self.attached and message.id in self._ended:
            return []  # it ended (``done`` sent) before the cancel arrived: nothing left to stop
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
        # the start's text: all of it, unless incremental; the streams generating here, this one
        # among them, share the engine's steps whether or not its gauges count them yet
        advice = service.pace.advice(msg.text or None, open_streams=service.registry.generating())
        started = wire.started(
            msg.id, attachment.slot, *_audio_of(stream), stream.seed, advice, frame_ms=request.frame_ms
        )
        return [Send(started), StartPump(attachment, stream.outbox.sent_index)]

    def _resume(self, msg: Resume) -> list[Action]:
        service = self._service
        try:
            stream = service.find(msg.stream, self._owner)
        except UnknownStream:
            return self._resume_elsewhere(msg)
        try:
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
        received = None if stream.text is None else stream.text.received
        resumed = wire.resumed(stream.name, attachment.slot, msg.after_seq, *_audio_of(stream), received)
        self._metrics.resumes.labels(how="local").inc()
        return [*actions, Send(resumed), StartPump(attachment, index)]

    # --- resumes of streams this replica does not hold (docs/operations.md, "Resume on any replica")

    def _resume_elsewhere(self, msg: Resume) -> list[Action]:
        """Forward to the owner the token names, or regenerate here; refuse a token not ours."""
        router = self._service.router
        claims = None if router is None or self._forwarded else router.verify(msg.stream)
        if router is None or claims is None:  # no signed tokens, forged, or already forwarded once
            self._metrics.resumes.labels(how="unknown").inc()
            raise ProtocolError("unknown_stream", "no stream with this token is held here", token=msg.stream)
        actions: list[Action] = []
        if (mine := self._remote.pop(msg.stream, None)) is not None:
            actions.append(StopForward(mine))  # resumed again on the same connection
        name = msg.request.id if msg.request is not None else None
        self._check_room(name or "", token=msg.stream)
        owner = router.forward_target(claims)
        if owner is not None:
            remote = Remote(msg, claims, self._free_slot(), owner)
            self._remote[msg.stream] = remote
            return [*actions, Forward(remote)]
        if not router.is_mine(claims):  # signed, but outside --forward-allow: never connect
            log.warning("resume token names %s, outside --forward-allow: refused", claims.owner)
            self._metrics.resumes.labels(how="unknown").inc()
            raise ProtocolError("unknown_stream", "no stream with this token is held here", token=msg.stream)
        point = ResumePoint(msg.after_seq, msg.segment, msg.segment_sample)
        return [*actions, *self._regenerate(msg, point, self._free_slot(), fresh=True)]

    def _regenerate(self, msg: Resume, point: ResumePoint, slot: int, *, fresh: bool) -> list[Action]:
        """Start the lost stream again here, from ``point`` on (``fresh``: answer ``resumed``)."""
        service, router = self._service, self._service.router
        claims = None if router is None else router.verify(msg.stream)
        if msg.request is None or claims is None:
            self._metrics.resumes.labels(how="unknown").inc()
            raise ProtocolError("unknown_stream", "the stream is gone", token=msg.stream)
        lease = Lease(self._abort)
        try:
            # regenerate checks the drain and the rate limit (one token, once the stream exists).
            request = wire.speech_request(msg.request)
            stream, degraded = service.regenerate(
                claims,
                request,
                point,
                lease,
                token=None if fresh else msg.stream,
                client=self._client,
                owner=self._owner,
            )
        except ServiceError as exc:
            self._metrics.resumes.labels(how="unknown").inc()
            raise wire.wire_error(exc, name=msg.request.id, token=msg.stream) from None
        attachment = self._attach(stream, lease, slot)
        actions: list[Action] = []
        if degraded is not None:
            actions.append(Send(wire.resume_degraded(stream.name, msg.stream, degraded)))
        if fresh:
            actions.append(Send(wire.resumed(stream.name, slot, point.after_seq, *_audio_of(stream))))
        self._metrics.resumes.labels(how="regenerated" if degraded is None else "degraded").inc()
        return [*actions, StartPump(attachment, stream.outbox.sent_index)]

    def relays(self, remote: Remote) -> bool:
        """Whether ``remote`` is still relayed from its owner on this connection."""
        return self._remote.get(remote.token) is remote

    def forward_answered(self, remote: Remote, name: str) -> bool:
        """The owner resumed ``remote`` (as stream ``name``); False: drop it (its id is live here)."""
        if self._remote.get(remote.token) is not remote:
            return False
        if remote.name is None and name in self.attached:
            del self._remote[remote.token]
            return False
        remote.name = name
        self._metrics.resumes.labels(how="forwarded").inc()
        return True

    def forward_ended(self, remote: Remote, outcome: Outcome) -> list[Action]:
        """How relaying ``remote`` ended: regenerate it here, pass the refusal on, or let it go."""
        if self._remote.get(remote.token) is not remote:
            return []  # stopped by a newer resume, or the connection is closing
        del self._remote[remote.token]
        msg, token = remote.resume, remote.token
        if isinstance(outcome, Finished):
            return self.close_if_idle()
        if isinstance(outcome, PassOn):
            return [Send(outcome.data), *self.close_if_idle()]
        if isinstance(outcome, (Refused, Unreachable)):
            log.info("stream %s: owner %s: %s", redact(token), remote.owner, outcome)
            try:
                return self._regenerate(msg, remote.progress.point(), remote.slot, fresh=True)
            except ProtocolError as err:
                self._metrics.errors.labels(code=err.code).inc()
                return [Send(wire.error(err)), *self.close_if_idle()]
        assert isinstance(outcome, Lost)
        log.warning("stream %s: its owner %s was lost: %s", redact(token), remote.owner, outcome.reason)
        try:
            return self._regenerate(msg, remote.progress.point(), remote.slot, fresh=False)
        except ProtocolError:
            # The client cannot know; a new connection makes it resume (and restart) the stream.
            return [Close(1012, "the replica that held a stream is gone")]

    def _live(self, name: str) -> Stream:
        attachment = self.attached.get(name)
        if attachment is None:
            raise ProtocolError("bad_request", f"no live stream with id {name!r}", name=name)
        return attachment.stream

    def _check_room(self, name: str, token: str | None = None) -> None:
        attached = self.attached
        if name in attached or any(r.name == name for r in self._remote.values() if name):
            raise ProtocolError("duplicate_id", f"stream id {name!r} is already live", name=name, token=token)
        if len(attached) + len(self._remote) >= self._info.max_streams:
            raise ProtocolError(
                "too_many_streams",
                f"at most {self._info.max_streams} streams per connection",
                name=name or None,
                token=token,
            )

    def _free_slot(self) -> int:
        used = {a.slot for a in self._attached.values()} | {r.slot for r in self._remote.values()}
        return next(n for n in range(len(used) + 1) if n not in used)

    def _attach(self, stream: Stream, lease: Lease, slot: int | None = None) -> Attachment:
        slot = self._free_slot() if slot is None else slot
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
            if not attachment.lease.revoked:  # ``done`` went out (not moved to another connection)
                self._ended.append(attachment.stream.name)
        if self._forwarded and not self.attached:  # the forwarding replica learns it is over
            return [Close(1000, "the forwarded stream is done or moved")]
        return self.close_if_idle()

    def close_if_idle(self) -> list[Action]:
        """During a drain, a connection with no streams left is closed with 1012."""
        idle = not self.attached and not self._remote
        return [DRAIN_CLOSE] if self._service.draining and idle else []

    def connection_lost(self) -> None:
        """The connection is gone: its streams wait for a resume (or are freed, TTL 0)."""
        for attachment in self._attached.values():
            attachment.stream.detach(attachment.lease)
        self._attached.clear()
