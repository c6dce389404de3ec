"""A resume forwarded to the replica that owns its stream, sans I/O: what it is, how it ended.

A :class:`Remote` is a stream sent on this client connection by its owner replica, through
an upstream connection (``server.frontends.websocket.forward``). The owner numbers its
own slots, so every message relayed down gets this connection's slot (:func:`reslot_frame`,
:func:`reslot_message`), and :class:`Progress` keeps where the client stands (the last seq
and segment relayed), so that a lost owner can be replaced by a regeneration here without
the client noticing. How a forward ended is one of the outcome values below.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from server.frontends.websocket.wire import HEADER, Resume, unpack_frame
from server.streams.failover import ResumePoint
from server.streams.routing import Claims


@dataclass
class Progress:
    """What the client has of a forwarded stream: the resume point, moved on as items are relayed.

    A ``segment`` message says its segment's ``index``; it counts once a frame at or past
    its seq went to the client (the mark goes out just before its frame).
    """

    after_seq: int
    segment: int | None = None
    segment_sample: int | None = None
    _marks: list[tuple[int, int, int]] = field(default_factory=list)  # relayed, frame not yet

    def frame(self, seq: int) -> None:
        """A frame went to the client; marks of frames up to it now count as taken."""
        self.after_seq = max(self.after_seq, seq)
        while self._marks and self._marks[0][0] <= self.after_seq:
            _, sample, index = self._marks.pop(0)
            self.segment, self.segment_sample = index, sample

    def mark(self, seq: int, sample: int, index: int) -> None:
        """A ``segment`` message went to the client (before its frame)."""
        if seq > self.after_seq:
            self._marks.append((seq, sample, index))

    def point(self) -> ResumePoint:
        """Where the client stands now."""
        return ResumePoint(self.after_seq, self.segment, self.segment_sample)


@dataclass(eq=False)
class Remote:
    """A stream of this connection that its owner replica sends (through ``owner``).

    Attributes:
        resume: the client's ``resume`` (its ``request`` allows a regeneration here).
        claims: the verified token's claims.
        slot: this connection's slot for it.
        owner: the owner's URL.
        name: the stream's id: the request's, else the owner's ``resumed`` says it.
        progress: where the client stands.
    """

    resume: Resume
    claims: Claims
    slot: int
    owner: str
    name: str | None = None
    progress: Progress = field(init=False)

    def __post_init__(self) -> None:
        r = self.resume
        self.progress = Progress(r.after_seq, r.segment, r.segment_sample)
        if self.name is None and r.request is not None:
            self.name = r.request.id

    @property
    def token(self) -> str:
        """The stream's token."""
        return self.resume.stream


@dataclass(frozen=True)
class Unreachable:
    """No answer from the owner (it is gone, draining past its timeout, or refused the upgrade)."""

    reason: str


@dataclass(frozen=True)
class Refused:
    """The owner does not hold the stream (``unknown_stream``)."""

    message: str


@dataclass(frozen=True)
class PassOn:
    """The owner refused the resume otherwise (``resume_expired``): its ``error`` goes to the client."""

    data: str


@dataclass(frozen=True)
class Finished:
    """The stream's ``done`` went to the client, or the stream was moved to another connection."""


@dataclass(frozen=True)
class Lost:
    """The owner went away mid-stream (the client has everything relayed so far)."""

    reason: str


Outcome = Unreachable | Refused | PassOn | Finished | Lost


def reslot_frame(data: bytes, slot: int) -> tuple[bytes, int]:
    """A binary frame from the owner under this connection's ``slot``, and its seq.

    Raises:
        ValueError: not a frame of this protocol.
    """
    header, _ = unpack_frame(data)
    packed = HEADER.pack(header.version, header.flags, slot, header.seq, header.sample)
    return packed + data[len(packed) :], header.seq


def reslot_message(data: str, slot: int) -> tuple[dict[str, Any], str]:
    """A text message from the owner (parsed) and as sent on under this connection's ``slot``.

    Raises:
        ValueError: not a JSON object.
    """
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError("not a JSON object")
    if "slot" not in message:
        return message, data
    message["slot"] = slot
    return message, json.dumps(message, ensure_ascii=False, separators=(",", ":"))
