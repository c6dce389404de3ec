"""Who may use the API, and who a client is: API keys, tenants, allowed origins, the client's identity.

:class:`AccessGate` checks API keys and origins and names the client, the same way for
the WebSocket and the HTTP endpoint (and any front end added later). With API keys
configured, a *client* is its key's tenant: a ``[name]`` in the keys file, or the key
itself (as a digest, never the key); it owns the streams and voices it makes
(:func:`tenant_of`). Without keys, a client is its IP address (a key it presents
proves nothing then) and there are no tenants: one user. Pure logic; no I/O but
reading the keys file.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final
from urllib.parse import parse_qs, urlsplit

from server.config import Settings
from server.errors import StartupError

#: A tenant's name in the keys file: ``[name]`` on its own line.
TENANT_NAME: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: An API key and the tenant it belongs to (None: its own).
KeyEntry = tuple[str, str | None]


class ApiKeys:
    """The accepted API keys (SHA-256 digests compared in constant time) and their tenants."""

    def __init__(self, keys: Iterable[str | KeyEntry]) -> None:
        entries = [(k, None) if isinstance(k, str) else k for k in keys]
        self._keys = [(hashlib.sha256(key.encode()).digest(), tenant) for key, tenant in entries if key]

    @property
    def required(self) -> bool:
        """Whether any key is configured (else everything is allowed)."""
        return bool(self._keys)

    def valid(self, key: str | None) -> bool:
        """Whether ``key`` is one of the accepted keys."""
        return self.identity(key) is not None

    def identity(self, key: str | None) -> str | None:
        """The client a valid ``key`` is: ``tenant:<name>`` for a named tenant, else ``key:<digest>``.

        Every configured key is compared (in constant time), so the answer's timing does not
        tell which one matched. None for a key that is not accepted.
        """
        if key is None:
            return None
        digest = hashlib.sha256(key.encode()).digest()
        found: str | None = None
        for known, tenant in self._keys:
            if hmac.compare_digest(digest, known) and found is None:
                found = f"tenant:{tenant}" if tenant is not None else client_identity(key, "")
        return found


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


def tenant_of(client: str) -> str | None:
    """Who owns what ``client`` makes (streams, voices): its key's tenant; None without keys.

    Only a configured key names a tenant; a client known by its IP (no keys configured,
    or Wyoming, which has none) has no tenant, and without tenants everything is shared.
    """
    return None if client.startswith("ip:") else client


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
        identity = self.api_keys.identity(key) if self.api_keys.required else None
        if self.api_keys.required and identity is None:
            raise AccessDenied("unauthorized", "a valid API key is required (Authorization: Bearer)")
        if not origin_allowed(headers.get("Origin"), self.allowed_origins):
            raise AccessDenied("forbidden_origin", "this Origin may not use the API")
        if identity is not None:
            return identity
        # No keys configured: a presented key is any string the client chose, so it is no
        # identity (it would let one client be as many as it likes for every per-client limit).
        return client_identity(None, client_ip(peer, headers, trust_forwarded_for=self.trust_forwarded_for))


def read_api_keys(settings: Settings) -> list[KeyEntry]:
    """Keys from ``--api-keys`` (each its own tenant) and ``--api-keys-file``.

    The file has one key per line (``#`` starts a comment line); a line ``[name]`` starts a
    tenant: the keys below it, until the next ``[name]``, share one tenant (a key rotated in
    beside the old one sees the same streams and voices). Keys above the first ``[name]`` are
    each their own tenant, so a file of the one-key-per-line format means what it always did.

    Raises:
        StartupError: the file cannot be read, or a ``[...]`` line is no tenant name.
    """
    keys: list[KeyEntry] = [(k.strip(), None) for k in settings.api_keys.split(",") if k.strip()]
    if settings.api_keys_file:
        try:
            lines = Path(settings.api_keys_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise StartupError(f"cannot read --api-keys-file {settings.api_keys_file}: {reason}") from None
        tenant: str | None = None
        for number, raw in enumerate(lines, start=1):
            line = raw.strip()
            if not line or raw.startswith("#"):
                continue
            if line.startswith("[") and line.endswith("]"):
                if not TENANT_NAME.fullmatch(line[1:-1]):
                    raise StartupError(
                        f"--api-keys-file {settings.api_keys_file}, line {number}: a tenant is "
                        "[name] with 1-64 letters, digits, '_', '.' or '-'"
                    )
                tenant = line[1:-1]
                continue
            keys.append((line, tenant))
    return keys
