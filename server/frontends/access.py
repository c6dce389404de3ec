"""Who may use the API, and who a client is: API keys, allowed origins, the client's identity.

:class:`AccessGate` checks API keys and origins and names the client for its rate
limits, the same way for the WebSocket and the HTTP endpoint (and any front end
added later). A *client* is its API key when it presented one (as a digest, never
the key itself), else its IP address. Pure logic; no I/O but reading the keys file.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from server.config import Settings
from server.errors import StartupError


class ApiKeys:
    """The accepted API keys, kept as SHA-256 digests and compared in constant time."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys if key]

    @property
    def required(self) -> bool:
        """Whether any key is configured (else everything is allowed)."""
        return bool(self._digests)

    def valid(self, key: str | None) -> bool:
        """Whether ``key`` is one of the accepted keys."""
        if key is None:
            return False
        digest = hashlib.sha256(key.encode()).digest()
        return any(hmac.compare_digest(digest, known) for known in self._digests)


def presented_key(path: str, headers: Mapping[str, str]) -> str | None:
    """The API key a request carries: ``Authorization: Bearer``, ``X-API-Key`` or ``?api_key=``.

    Browsers cannot set headers on a WebSocket, hence the query parameter.
    """
    auth = headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    if headers.get("X-API-Key"):
        return headers["X-API-Key"].strip()
    values = parse_qs(urlsplit(path).query).get("api_key")
    return values[0] if values else None


def origin_allowed(origin: str | None, allowed: frozenset[str]) -> bool:
    """Browsers always send ``Origin``; a request without one is not from a page and passes."""
    return not allowed or origin is None or origin in allowed


def client_ip(peer: str, headers: Mapping[str, str], *, trust_forwarded_for: bool) -> str:
    """The client's IP: the first ``X-Forwarded-For`` hop behind a trusted proxy, else the peer.

    Only trust the header when every request comes through a proxy that sets it
    (an ingress); otherwise any client could pick its own rate-limit identity.
    """
    if trust_forwarded_for:
        first = headers.get("X-Forwarded-For", "").split(",")[0].strip()
        if first:
            return first
    return peer


def client_identity(key: str | None, ip: str) -> str:
    """The rate-limit identity: a digest of the API key (never the key itself), else the IP."""
    if key:
        return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
    return "ip:" + ip


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
