"""What a connection's protocol asks its I/O to do: the actions ``session.py`` returns.

``server.frontends.websocket.connection`` carries each out on the socket (and
``forward.py`` the forwarding ones); the protocol itself never touches I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.frontends.messages import INVALID_CLOSE_CODE, INVALID_CLOSE_REASON
from server.frontends.websocket.handoff import Remote
from server.streams.lifecycle import Lease
from server.streams.stream import Stream


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


@dataclass(frozen=True)
class Forward:
    """Resume ``remote`` on its owner replica and relay it here (``forward.py``)."""

    remote: Remote


@dataclass(frozen=True)
class Relay:
    """Send a client message for ``remote`` on to its owner."""

    remote: Remote
    data: str


@dataclass(frozen=True)
class StopForward:
    """Stop relaying ``remote`` (its upstream connection closes)."""

    remote: Remote


Action = Send | StartPump | StopPump | Close | Forward | Relay | StopForward
DRAIN_CLOSE = Close(1012, "server is restarting")
#: Past ``--invalid-messages-per-s`` a connection is closed with the policy code (every front end's).
INVALID_CLOSE = Close(INVALID_CLOSE_CODE, INVALID_CLOSE_REASON)
