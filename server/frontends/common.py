"""What every front end shares: the facts it advertises, bounded sends, the bounds of request fields.

:class:`ServerInfo` is the small value a front end needs about the server
(``hello``); :func:`send_within` and :func:`abort_transport` are how
every front end drops a client that stops reading; the ``Annotated`` types bound
the sampling fields every front end accepts (the WebSocket's ``start``, the
OpenAI body), so a request cannot ask for absurd values on any port.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec

from server.metrics import Metrics

log = logging.getLogger(__name__)


class SendAborted(Exception):
    """The connection was aborted (a send blocked, or its stream failed); stop using it."""


async def send_within(send: Awaitable[None], timeout_s: float, abort: Callable[[str], None]) -> None:
    """Await ``send``; past ``timeout_s`` the peer is not reading: ``abort`` it, raise :class:`SendAborted`.

    Every front end bounds its writes this way, so a client that stops reading is dropped
    rather than allowed to hold the stream's buffers.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await send
    except TimeoutError:
        abort(f"send blocked for {timeout_s} s")
        raise SendAborted from None


def abort_transport(
    transport: asyncio.WriteTransport | None, metrics: Metrics, who: str, reason: str
) -> None:
    """Drop ``who``'s TCP connection at once (no goodbye: the peer is not reading), counted as aborted."""
    log.warning("aborting %s: %s", who, reason)
    metrics.errors.labels(code="aborted").inc()
    if transport is not None:
        transport.abort()


@dataclass(frozen=True, kw_only=True)
class ServerInfo:
    """What the server advertises (the ``hello`` message); the voices are the catalog's (they change)."""

    server: str
    formats: tuple[str, ...]
    sample_rates: tuple[int, ...]
    max_text_chars: int
    max_streams: int
    resume_ttl_s: float
    #: The deepest nesting a client's JSON may have (``--max-json-depth``).
    max_json_depth: int = 32
    sample_rate: int = 24_000
    #: Which weights the engine speaks with: ``official``, ``unverified`` or ``random``
    #: (``None``: an engine without weights, such as the test engine).
    weights: str | None = None
    #: How the engine computes (``dtype``, ``quantize``, ``token_step``, and
    #: ``token_step_fallback`` when the chosen step failed at warm-up); empty for the test engine.
    compute: Mapping[str, str] = field(default_factory=dict)


# Without an explicit bound a request could ask for absurd sampling values.
Speed = Annotated[float, msgspec.Meta(ge=0.5, le=2.0)]
Temperature = Annotated[float, msgspec.Meta(gt=0.0, le=5.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=1, le=1000)]
Seed = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
#: A wire frame's length: Opus's own packet lengths (the formats with fixed frames take them).
FrameMs = Literal[20, 40, 60]
#: ``[oral_N][laugh_N][break_N]`` at most (the service checks the tags themselves).
RefinePrompt = Annotated[str, msgspec.Meta(max_length=64)]
