"""Stream tokens: unguessable, routable by the ingress, and redacted for logs."""

from __future__ import annotations

import re
import secrets

_ROUTE = re.compile(r"[0-9A-Za-z_-]{1,64}")


def new_stream_token(route: str | None = None) -> str:
    """An unguessable stream token: 192 random bits, URL-safe.

    With a ``route`` (the handshake's ``X-Request-ID`` that the ingress hashed
    to pick this replica), the token is ``<route>.<secret>``, so that the ingress
    can hash a reconnect's ``?resume=`` back to the same replica. Only the secret
    part is unguessable; the route is not secret.
    """
    secret = secrets.token_urlsafe(24)
    if route is not None and _ROUTE.fullmatch(route):
        return f"{route}.{secret}"
    return secret


def redact(token: str) -> str:
    """A token as it may appear in logs: the route and 6 characters of the secret."""
    parts = token.split(".")
    if len(parts) >= 4:  # signed (server.streams.routing): [route.]owner.digests.secret.mac
        route = f"{parts[0]}." if len(parts) == 5 else ""
        return f"{route}{parts[-2][:6]}…"
    route, dot, secret = token.rpartition(".")
    return f"{route}{dot}{secret[:6]}…"
