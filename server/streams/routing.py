"""Resume tokens that name the replica owning their stream, signed with the replicas' shared key.

With a shared secret (``--resume-secret`` / ``--resume-secret-file``) a stream's token is::

    [<route>.]<owner>.<digests>.<nonce>.<mac>

- ``route``: the ingress's ``X-Request-ID`` when the handshake had one (as without a secret);
- ``owner``: base64url of the owner's ``--advertise-url`` (``ws://10.1.2.3:8080``);
- ``digests``: base64url of 8 bytes naming what decides the audio on the owner (engine, weights,
  precision, encoder settings: :func:`audio_fingerprint`) and 8 bytes of the request
  (:func:`request_digest`), so another replica can tell whether it can regenerate the stream
  exactly, and whether the request a client sends with a resume is the stream's;
- ``nonce``: 192 random bits, the unguessable part;
- ``mac``: HMAC-SHA256 of everything before it with the key, truncated to 128 bits.

:meth:`Router.verify` checks the MAC in constant time before it reads anything else, so a
client cannot point a token at another address; :meth:`Router.forward_target` then admits only
an owner whose address is an IP inside ``--forward-allow`` and is not this replica, or one of
its sibling front-end processes on this host (``--frontend-processes N``: each child names its
own loopback port, :func:`sibling_urls`). Clients
treat tokens as opaque. Pure logic, no I/O (reading the key file happens in
:func:`router_from_settings`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import ipaddress
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from server.config import VERSION, Settings
from server.engine_api import EngineInfo
from server.errors import StartupError
from server.streams.request import SpeechRequest

#: The shortest key accepted (characters of the secret).
MIN_SECRET_CHARS = 16
#: The longest ``--advertise-url``: a token must fit the resume message's 256 characters.
MAX_ADVERTISE_CHARS = 80
#: How far a peer's proof of forwarding may lie in the past or future (clock skew), seconds.
PEER_PROOF_WINDOW_S = 120
_MAC_BYTES = 16
#: A peer proof's stamp (whole seconds since the epoch) has at most this many digits; its MAC is
#: the base64 of :data:`_MAC_BYTES` bytes. Anything longer is no proof, refused before any work.
_STAMP_DIGITS = 12
_PROOF_CHARS = _STAMP_DIGITS + 1 + 22
#: The longest resume token (the resume message's ``stream`` field).
MAX_TOKEN_CHARS = 256
_DIGEST_BYTES = 8
_ROUTE = re.compile(r"[0-9A-Za-z_-]{1,64}")
_PART = re.compile(r"[0-9A-Za-z_-]+")
_CONTEXT = b"chattts-stream resume token v1\x00"
_PEER_CONTEXT = b"chattts-stream forwarded resume v1\x00"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class Claims:
    """What a verified token says about its stream.

    Attributes:
        owner: the owner's advertise URL (``ws://IP:PORT``).
        fingerprint: 8 bytes naming what decided the audio on the owner.
        request: 8 bytes naming the stream's request (with its seed).
    """

    owner: str
    fingerprint: bytes
    request: bytes


def request_digest(request: SpeechRequest, owner: str | None = None) -> bytes:
    """8 bytes naming everything of a request that decides its audio (its seed included).

    With ``owner`` (the stream's tenant) the digest names it too: a token then only matches
    a request resent by that tenant, so no other tenant can regenerate the stream.
    """
    fields = dataclasses.asdict(request)
    if fields.get("frame_ms") == 20:  # the default: the digest of a request from before the field
        del fields["frame_ms"]
    text = "\x1f".join(f"{key}={fields[key]!r}" for key in sorted(fields))
    if owner is not None:
        text += f"\x1fowner={owner!r}"
    return hashlib.sha256(text.encode("utf-8")).digest()[:_DIGEST_BYTES]


def audio_fingerprint(settings: Settings, info: EngineInfo) -> bytes:
    """8 bytes naming what, besides the request, decides a stream's bytes on this replica.

    Two replicas with the same fingerprint produce the same stream from the same request
    (where the engine is batch-invariant: see :func:`inexact_engine`).
    """
    s = settings
    parts = (
        VERSION,
        info.name,
        s.model_dir,
        s.dev_model,
        info.extra.get("weights", ""),
        info.extra.get("dtype", ""),
        info.extra.get("device", "").partition(":")[0],  # the device type: cuda:0 and cuda:1 agree
        s.block_schedule,
        s.segment_max_chars,
        s.segment_max_tokens,
        s.refine_max_tokens,
        s.opus_bitrate,
        s.opus_complexity,
        s.ogg_page_ms,
        s.mp3_bitrate,
    )
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()[:_DIGEST_BYTES]


def inexact_engine(info: EngineInfo) -> str | None:
    """Why this engine cannot promise the same audio for a seeded segment in another batch, if so.

    In float32 the ChatTTS engine draws the same tokens in any batch; its batched vocoder may
    still round a sample by 1 LSB of pcm16 differently (docs/operations.md, "Resume on any replica"): not
    announced. In bf16/fp16 the tokens themselves can change.
    """
    dtype = info.extra.get("dtype")
    if info.name == "fake" or dtype in (None, "float32"):
        return None
    return f"the model runs in {dtype}, where a batch changes the rounding (only float32 is exact)"


class Router:
    """Mints and verifies signed tokens; decides where a resume may be forwarded.

    Args:
        key: the replicas' shared secret.
        advertise_url: this replica's address for the others.
        allow: the networks an owner's address must lie in.
        fingerprint: :func:`audio_fingerprint` of this replica.
        siblings: the loopback URLs of the other front-end processes of this host (exactly these
            are admitted besides ``allow``; an operator's ``--forward-allow`` is not widened).
    """

    def __init__(
        self,
        key: bytes,
        advertise_url: str,
        allow: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...],
        fingerprint: bytes = b"\x00" * _DIGEST_BYTES,
        siblings: frozenset[str] = frozenset(),
    ) -> None:
        self._key = key
        self.advertise_url = advertise_url
        self._allow = allow
        self.fingerprint = fingerprint
        self.siblings = siblings
        # Loopback is another replica only where this one is on loopback too (tests, one host);
        # in a pod it would be the pod itself or a sidecar. A front-end process's own address
        # is on loopback for its siblings only: other loopback addresses stay refused.
        self._loopback_peers = _is_loopback(advertise_url) and not siblings

    def mint(self, request: SpeechRequest, route: str | None = None, owner: str | None = None) -> str:
        """A new token for a stream of ``request`` owned by this replica (and tenant ``owner``)."""
        body = ".".join(
            (
                _b64(self.advertise_url.encode()),
                _b64(self.fingerprint + request_digest(request, owner)),
                secrets.token_urlsafe(24),
            )
        )
        if route is not None and _ROUTE.fullmatch(route):
            body = f"{route}.{body}"
        return f"{body}.{self._mac(body)}"

    def _mac(self, body: str) -> str:
        return _b64(hmac.new(self._key, _CONTEXT + body.encode(), hashlib.sha256).digest()[:_MAC_BYTES])

    def verify(self, token: str) -> Claims | None:
        """The claims of a token this key signed; None for anything else (forged, tampered, foreign)."""
        body, dot, mac = token.rpartition(".")
        if not dot or not _PART.fullmatch(mac) or not token.isascii():
            return None
        if not hmac.compare_digest(self._mac(body).encode(), mac.encode()):
            return None
        parts = body.split(".")
        if len(parts) not in (3, 4):
            return None
        owner_b64, digests_b64 = parts[-3], parts[-2]
        try:
            owner = _unb64(owner_b64).decode("utf-8")
            digests = _unb64(digests_b64)
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return None
        if len(digests) != 2 * _DIGEST_BYTES:
            return None
        return Claims(owner, digests[:_DIGEST_BYTES], digests[_DIGEST_BYTES:])

    def is_mine(self, claims: Claims) -> bool:
        """Whether the token names this replica as its owner."""
        return claims.owner == self.advertise_url

    def forward_target(self, claims: Claims) -> str | None:
        """The owner's URL when a resume may be forwarded there, else None (never this replica)."""
        if self.is_mine(claims):
            return None
        if claims.owner in self.siblings:
            return claims.owner
        if _is_loopback(claims.owner) and not self._loopback_peers:
            return None
        return claims.owner if allowed_address(claims.owner, self._allow) else None

    def peer_proof(self, token: str, now: float) -> str:
        """The header value that tells an owner this connection comes from a replica (for ``token``)."""
        stamp = str(int(now))
        return f"{stamp}.{self._peer_mac(stamp, token)}"

    def _peer_mac(self, stamp: str, token: str) -> str:
        message = _PEER_CONTEXT + stamp.encode() + b"\x00" + token.encode()
        return _b64(hmac.new(self._key, message, hashlib.sha256).digest()[:_MAC_BYTES])

    def is_peer(self, proof: str | None, token: str | None, now: float) -> bool:
        """Whether ``proof`` is a fresh :meth:`peer_proof` for ``token`` made with this key.

        Bounded work whatever the client sent (during a drain this runs before any key is
        checked): a proof or token longer than one can be, or a stamp that is not a short
        decimal number, is simply not a proof.
        """
        if not proof or not token or len(proof) > _PROOF_CHARS or len(token) > MAX_TOKEN_CHARS:
            return False
        if not proof.isascii() or not token.isascii():
            return False
        stamp, _, mac = proof.partition(".")
        if (
            not (stamp.isdigit() and len(stamp) <= _STAMP_DIGITS)
            or abs(now - int(stamp)) > PEER_PROOF_WINDOW_S
        ):
            return False
        return hmac.compare_digest(self._peer_mac(stamp, token).encode(), mac.encode())


def _is_loopback(url: str) -> bool:
    try:
        return ipaddress.ip_address(urlsplit(url).hostname or "").is_loopback
    except ValueError:
        return False


def allowed_address(url: str, allow: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]) -> bool:
    """Whether ``url`` is ``ws(s)://IP:PORT`` with the IP inside one of ``allow``."""
    try:
        parts = urlsplit(url)
        port = parts.port
        address = ipaddress.ip_address(parts.hostname or "")
    except ValueError:
        return False
    if parts.scheme not in ("ws", "wss") or port is None or parts.path not in ("", "/"):
        return False
    if parts.query or parts.fragment or parts.username is not None or parts.password is not None:
        return False
    return any(address.version == net.version and address in net for net in allow)


def parse_networks(text: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """``--forward-allow``: comma-separated CIDRs.

    Raises:
        ValueError: naming the entry that is not a network.
    """
    networks = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(f"--forward-allow: {entry!r} is not a network such as 10.0.0.0/8") from None
    return tuple(networks)


def read_secret(settings: Settings) -> str:
    """The shared key: ``--resume-secret-file``'s content (stripped), else ``--resume-secret``.

    Raises:
        StartupError: the file cannot be read, or the key is too short.
    """
    secret = settings.resume_secret
    if settings.resume_secret_file:
        try:
            secret = Path(settings.resume_secret_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise StartupError(
                f"cannot read --resume-secret-file {settings.resume_secret_file}: {reason}"
            ) from None
    if secret and len(secret) < MIN_SECRET_CHARS:
        flag = "--resume-secret-file" if settings.resume_secret_file else "--resume-secret"
        raise StartupError(f"{flag}: the shared key needs at least {MIN_SECRET_CHARS} characters")
    return secret


def advertise_url(settings: Settings, port: int) -> str:
    """``--advertise-url``, or ``ws://--host:PORT`` when the host is an address to reach.

    Raises:
        StartupError: none can be made, or it is not ``ws(s)://IP:PORT``.
    """
    url = settings.advertise_url
    if not url:
        try:
            host = ipaddress.ip_address(settings.host)
        except ValueError:
            host = None
        if host is None or host.is_unspecified:
            raise StartupError(
                "--advertise-url: set it to ws://POD_IP:PORT (--host does not say where the other "
                "replicas reach this one)"
            )
        url = f"ws://{settings.host}:{port}" if host.version == 4 else f"ws://[{settings.host}]:{port}"
    everywhere = parse_networks("0.0.0.0/0,::/0")
    if len(url) > MAX_ADVERTISE_CHARS or not allowed_address(url, everywhere):
        raise StartupError(
            f"--advertise-url {url!r}: expected ws://IP:PORT (an IP address, at most "
            f"{MAX_ADVERTISE_CHARS} characters)"
        )
    return url.rstrip("/")


def sibling_urls(settings: Settings) -> tuple[str, frozenset[str]]:
    """A front-end process's own loopback URL and its siblings' (``--sibling-ports``, its own first).

    Raises:
        StartupError: not a comma-separated list of ports.
    """
    try:
        ports = [int(p) for p in settings.sibling_ports.split(",")]
    except ValueError:
        ports = []
    if len(ports) < 2 or not all(0 < p < 65536 for p in ports):
        raise StartupError(
            f"--sibling-ports {settings.sibling_ports!r}: expected PORT,PORT,... (its own first)"
        )
    own, *others = (f"ws://127.0.0.1:{p}" for p in ports)
    return own, frozenset(others)


@dataclass(frozen=True)
class RouterConfig:
    """The checked flags of a router (before the engine is loaded)."""

    key: bytes
    advertise_url: str
    allow: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    siblings: frozenset[str] = frozenset()


def router_config(settings: Settings, port: int) -> RouterConfig | None:
    """The router's flags, checked; None without a shared secret (single-replica resume).

    Raises:
        StartupError: one line naming the flag to fix.
    """
    secret = read_secret(settings)
    if not secret:
        return None
    try:
        allow = parse_networks(settings.forward_allow)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    if settings.sibling_ports:  # a child of --frontend-processes N: its own port names its streams
        own, siblings = sibling_urls(settings)
        return RouterConfig(secret.encode("utf-8"), own, allow, siblings)
    return RouterConfig(secret.encode("utf-8"), advertise_url(settings, port), allow)


def make_router(config: RouterConfig, settings: Settings, info: EngineInfo) -> Router:
    """The router of this replica, once its engine is known (its audio fingerprint)."""
    fingerprint = audio_fingerprint(settings, info)
    return Router(config.key, config.advertise_url, config.allow, fingerprint, config.siblings)
