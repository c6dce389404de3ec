"""What every front end shares: the facts it advertises and the gate every request passes.

:class:`ServerInfo` is the small value a front end needs about the server
(``hello``, voice lists). :class:`AccessGate` checks API keys and origins and
names the client for its rate limits, the same way for the WebSocket and the
HTTP endpoint (and any front end added later).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from server.config import Settings
from server.errors import StartupError
from server.limits import ApiKeys, client_identity, client_ip, origin_allowed, presented_key
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


#: OpenAI voice names → reproducible ChatTTS voices (random speakers, not OpenAI's timbres);
#: the OpenAI-compatible endpoint and the Wyoming server take these names.
_SEEDED = "ash ballad coral echo fable nova onyx sage shimmer verse marin cedar".split()  # noqa: SIM905
OPENAI_VOICES: Final = {"alloy": "default"} | {name: f"seed:{n}" for n, name in enumerate(_SEEDED, start=11)}


@dataclass(frozen=True, kw_only=True)
class ServerInfo:
    """What the server advertises (the ``hello`` message, the voices list)."""

    server: str
    voices: tuple[str, ...]
    formats: tuple[str, ...]
    sample_rates: tuple[int, ...]
    max_text_chars: int
    max_streams: int
    resume_ttl_s: float
    sample_rate: int = 24_000
    #: Which weights the engine speaks with: ``official``, ``unverified`` or ``random``
    #: (``None``: an engine without weights, such as the test engine).
    weights: str | None = None


class AccessDenied(Exception):
    """Refused: no valid API key (``unauthorized``) or an origin not allowed (``forbidden_origin``)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class AccessGate:
    """API keys, allowed origins and the client's identity for rate limits."""

    def __init__(
        self, api_keys: ApiKeys, allowed_origins: frozenset[str], *, trust_forwarded_for: bool
    ) -> None:
        self.api_keys = api_keys
        self.allowed_origins = allowed_origins
        self.trust_forwarded_for = trust_forwarded_for

    @classmethod
    def from_settings(cls, settings: Settings) -> AccessGate:
        """The gate ``settings`` describe (reads ``--api-keys-file``).

        Raises:
            StartupError: the API-keys file cannot be read.
        """
        origins = frozenset(o.strip() for o in settings.allowed_origins.split(",") if o.strip())
        return cls(
            ApiKeys(read_api_keys(settings)), origins, trust_forwarded_for=settings.trust_forwarded_for
        )

    def admit(self, path: str, headers: Mapping[str, str], peer: str) -> str:
        """Check a request; returns the client's rate-limit identity.

        Args:
            path: the request target (an ``?api_key=`` may be in it).
            headers: the request headers.
            peer: the remote IP address.

        Raises:
            AccessDenied: no valid API key, or an origin not allowed.
        """
        key = presented_key(path, headers)
        if self.api_keys.required and not self.api_keys.valid(key):
            raise AccessDenied("unauthorized", "a valid API key is required (Authorization: Bearer)")
        if not origin_allowed(headers.get("Origin"), self.allowed_origins):
            raise AccessDenied("forbidden_origin", "this Origin may not use the API")
        return client_identity(key, client_ip(peer, headers, trust_forwarded_for=self.trust_forwarded_for))


def read_api_keys(settings: Settings) -> list[str]:
    """Keys from ``--api-keys`` and, one per line, ``--api-keys-file``.

    Raises:
        StartupError: the file cannot be read.
    """
    keys = [k.strip() for k in settings.api_keys.split(",") if k.strip()]
    if settings.api_keys_file:
        try:
            lines = Path(settings.api_keys_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise StartupError(f"cannot read --api-keys-file {settings.api_keys_file}: {reason}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    return keys
