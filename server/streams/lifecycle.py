"""A stream's life: its states, its sender's lease, and the bookkeeping of each transition.

A stream (:class:`~server.streams.stream.Stream`) moves through these states::

    ATTACHED ── connection lost ──▶ DETACHED ── TTL or replay budget ──▶ EXPIRED
       │  ▲                            │
       │  └────────── resume ──────────┘     (a resume may also move an ATTACHED
       └── done sent ──▶ DELIVERED             or DELIVERED stream to a new owner)
    DELIVERED ── TTL ──▶ CLOSED;   any state ── close ──▶ CLOSED

Each stream is counted once in ``chattts_streams{reason}``: when its ``done``
is first delivered (its done reason), when it expires (``expired``), or when it
is closed before that (the reason given); ``chattts_active_streams`` counts
those not counted yet.

:class:`Lifecycle` keeps where one stream is (its state, the lease of the front end that
sends it, since when it has had none, whether its end was counted) and moves it; the stream
decides which transition an event means and frees what it holds when it ends.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from server.metrics import Metrics
from server.streams.outbox import Outbox


class StreamState(enum.Enum):
    """Where a stream is in its life (see the module docstring for the transitions)."""

    ATTACHED = "attached"  # a front end sends its items
    DETACHED = "detached"  # lost its connection before done went out: resumable until the TTL
    DELIVERED = "delivered"  # done went out; kept for the TTL in case the last bytes were lost
    EXPIRED = "expired"  # not resumed in time (terminal)
    CLOSED = "closed"  # freed (terminal)


class Lease:
    """A front end's right to send one stream; revoked when the stream moves elsewhere.

    Args:
        abort: drops the front end's connection (its reader fell too far behind).
    """

    __slots__ = ("abort", "revoked")

    def __init__(self, abort: Callable[[str], None]) -> None:
        self.abort = abort
        self.revoked = False


class Lifecycle:
    """One stream's state, its sender's lease, since when it has had none, and its end counted once.

    Counts the stream as active from now on. Each transition also tells the stream's outbox
    whether a sender reads it (``Outbox.attached``) and wakes a sender whose lease it revokes.

    Args:
        lease: the front end that sends the stream first.
        outbox: the stream's outbox.
        metrics: where its end is counted.
        clock: when it loses its sender.
    """

    __slots__ = ("_clock", "_idle_at", "_metrics", "_outbox", "counted", "lease", "state")

    def __init__(self, lease: Lease, outbox: Outbox, metrics: Metrics, clock: Callable[[], float]) -> None:
        self.state = StreamState.ATTACHED
        #: The front end sending the stream now (None while detached, delivered or gone).
        self.lease: Lease | None = lease
        #: Its end was counted (delivered, expired or closed): no longer active.
        self.counted = False
        self._idle_at: float | None = None
        self._outbox = outbox
        self._metrics = metrics
        self._clock = clock
        metrics.active_streams.inc()

    def idle_since(self) -> float | None:
        """When it lost its sender (detached or delivered); None while attached or gone."""
        return self._idle_at if self.state in (StreamState.DETACHED, StreamState.DELIVERED) else None

    def attach(self, lease: Lease) -> None:
        """``lease`` sends the stream from now on; a previous sender's lease is revoked."""
        self._revoke()
        self.lease = lease
        self.state = StreamState.ATTACHED
        self._idle_at = None
        self._outbox.attached = True

    def release(self, state: StreamState) -> None:
        """Its sender is gone (``DETACHED``) or done (``DELIVERED``): idle from now on."""
        self.lease = None
        self.state = state
        self._idle_at = self._clock()
        self._outbox.attached = False

    def end(self, state: StreamState) -> None:
        """It is gone (``EXPIRED`` or ``CLOSED``): no one sends it any more."""
        self._revoke()
        self.lease = None
        self.state = state
        self._idle_at = None
        self._outbox.attached = False

    def count(self, reason: str) -> None:
        """Count its end as ``reason``, unless it was counted already."""
        if not self.counted:
            self.counted = True
            self._metrics.streams_total.labels(reason=reason).inc()
            self._metrics.active_streams.dec()

    def _revoke(self) -> None:
        if self.lease is not None:
            self.lease.revoked = True
            self._outbox.poke()  # its sender wakes up and leaves
