"""Signed resume tokens: they verify only unchanged and with the key; owners only inside the allowed set."""

from __future__ import annotations

import dataclasses
import hmac
from pathlib import Path

import pytest

from server.config import load_settings
from server.engine_api import EngineInfo
from server.errors import StartupError
from server.streams import routing
from server.streams.request import SpeechRequest
from server.streams.routing import Router, allowed_address, parse_networks

KEY = b"unit-test-key-0123456789"
HERE = "ws://10.1.2.3:8080"
PRIVATE = parse_networks("10.0.0.0/8")
REQUEST = SpeechRequest(name="s", text="Hello there.", seed=7, format="opus")


def router(url: str = HERE, key: bytes = KEY) -> Router:
    return Router(key, url, PRIVATE, b"F" * 8)


def test_a_token_verifies_to_its_owner_fingerprint_and_request() -> None:
    token = router().mint(REQUEST)
    claims = router("ws://10.9.9.9:8080").verify(token)  # any replica with the key
    assert claims is not None
    assert claims.owner == HERE and claims.fingerprint == b"F" * 8
    assert claims.request == routing.request_digest(REQUEST)
    assert len(token) <= 256 and token.isascii()


def test_tokens_are_unguessable_and_carry_the_ingress_route() -> None:
    r = router()
    assert r.mint(REQUEST) != r.mint(REQUEST)
    routed = r.mint(REQUEST, route="req-42")
    assert routed.startswith("req-42.") and r.verify(routed) is not None
    assert r.mint(REQUEST, route="bad route!").count(".") == 3  # an unusable route is left out


def tampered(token: str) -> list[str]:
    """Every single-character change of ``token``, plus reordered and truncated parts."""
    variants = []
    for i, char in enumerate(token):
        for other in ("A", "b", "-", "."):
            if other != char:
                variants.append(token[:i] + other + token[i + 1 :])
    parts = token.split(".")
    variants += [".".join(reversed(parts)), ".".join(parts[:-1]), token + ".x", token[:-1], "." + token]
    return variants


def test_every_change_to_a_token_fails_verification() -> None:
    r = router()
    token = r.mint(REQUEST)
    assert [v for v in tampered(token) if r.verify(v) is not None] == []


def test_another_key_or_no_key_verifies_nothing() -> None:
    token = router().mint(REQUEST)
    assert router(key=b"another-deployment-key!!").verify(token) is None
    assert router().verify("") is None and router().verify("....") is None
    assert router().verify("é.é.é.é.é") is None


def test_verification_compares_the_mac_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(routing.hmac, "compare_digest", spy)
    r = router()
    assert r.verify(r.mint(REQUEST)) is not None
    assert len(calls) == 1


@dataclasses.dataclass(frozen=True)
class _Old:
    """A request as it was before ``frame_ms``: the same fields less that one."""

    name: str
    text: str | None
    voice: str
    speed: float
    format: str
    sample_rate: int
    seed: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    incremental: bool
    max_buffer_delay_ms: float | None
    refine: bool
    refine_prompt: str
    word_timestamps: bool


def test_the_request_digest_covers_every_field_that_changes_the_audio() -> None:
    digest = routing.request_digest(REQUEST)
    changes = {
        "name": "t", "text": "Other.", "voice": "alto", "speed": 1.5, "format": "pcm16",
        "sample_rate": 16000, "seed": 8, "temperature": 0.5, "top_p": 0.5, "top_k": 5,
        "incremental": True, "max_buffer_delay_ms": 100.0, "refine": True, "refine_prompt": "[oral_2]",
        "word_timestamps": True,  # not the audio, but the stream's messages
        "frame_ms": 60,  # the frames' bytes
    }  # fmt: skip
    assert set(changes) == {f.name for f in dataclasses.fields(SpeechRequest)}
    for name, value in changes.items():
        assert routing.request_digest(dataclasses.replace(REQUEST, **{name: value})) != digest, name
    # frame_ms 20 (the default) is left out, so a request from before the field has its digest.
    fields = {k: v for k, v in dataclasses.asdict(REQUEST).items() if k != "frame_ms"}
    assert routing.request_digest(_Old(**fields)) == digest  # type: ignore[arg-type]
    # The tenant is part of it: another tenant's resend of the same request does not match.
    assert routing.request_digest(REQUEST, "tenant-a") not in {digest, routing.request_digest(REQUEST, "b")}


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("ws://10.1.2.3:8080", True),
        ("wss://10.1.2.3:443", True),
        ("ws://10.1.2.3:8080/", True),
        ("ws://11.1.2.3:8080", False),  # outside the networks
        ("ws://10.1.2.3", False),  # no port
        ("http://10.1.2.3:8080", False),
        ("ws://pod.example:8080", False),  # a name would need resolving: never
        ("ws://10.1.2.3:8080/v1/stream", False),
        ("ws://10.1.2.3:8080?x=1", False),
        ("ws://user:pw@10.1.2.3:8080", False),
        ("ws://[fd00::1]:8080", False),  # another family than the networks
        ("ws://10.1.2.3:99999", False),
        ("", False),
    ],
)
def test_only_an_ip_and_port_inside_the_networks_may_be_forwarded_to(url: str, allowed: bool) -> None:
    assert allowed_address(url, PRIVATE) is allowed


def test_a_replica_never_forwards_to_itself() -> None:
    r = router()
    claims = r.verify(r.mint(REQUEST))
    assert claims is not None and r.is_mine(claims) and r.forward_target(claims) is None
    other = router("ws://10.0.0.9:8080")
    assert other.forward_target(claims) == HERE


def test_a_peer_proof_is_bound_to_the_token_key_and_time() -> None:
    r = router()
    proof = r.peer_proof("tok", now=1000.0)
    assert r.is_peer(proof, "tok", now=1000.0) and r.is_peer(proof, "tok", now=1100.0)
    assert not r.is_peer(proof, "tok", now=1000.0 + routing.PEER_PROOF_WINDOW_S + 1)
    assert not r.is_peer(proof, "other", now=1000.0)
    assert not router(key=b"another-deployment-key!!").is_peer(proof, "tok", now=1000.0)
    assert not r.is_peer(None, "tok", now=1000.0) and not r.is_peer("x.y", "tok", now=1000.0)


def test_the_fingerprint_names_what_decides_the_audio() -> None:
    settings = load_settings([], env={})
    info = EngineInfo(name="chattts", voices=("default",), samples_per_token=512, extra={"dtype": "float32"})
    base = routing.audio_fingerprint(settings, info)
    assert routing.audio_fingerprint(load_settings(["--max-batch", "4"], env={}), info) == base
    assert routing.audio_fingerprint(load_settings(["--opus-bitrate", "24000"], env={}), info) != base
    bf16 = dataclasses.replace(info, extra={"dtype": "bfloat16"})
    assert routing.audio_fingerprint(settings, bf16) != base
    gpu0 = dataclasses.replace(info, extra={"dtype": "float32", "device": "cuda:0"})
    gpu1 = dataclasses.replace(info, extra={"dtype": "float32", "device": "cuda:1"})
    assert routing.audio_fingerprint(settings, gpu0) == routing.audio_fingerprint(settings, gpu1)
    assert routing.inexact_engine(info) is None and "bfloat16" in (routing.inexact_engine(bf16) or "")


def test_the_flags_are_checked_at_start(tmp_path: Path) -> None:
    assert routing.router_config(load_settings([], env={}), 8080) is None  # no secret: no router
    short = load_settings(["--resume-secret", "short"], env={})
    with pytest.raises(StartupError, match="--resume-secret: the shared key needs at least 16"):
        routing.router_config(short, 8080)
    missing = load_settings(["--resume-secret-file", str(tmp_path / "nope")], env={})
    with pytest.raises(StartupError, match="cannot read --resume-secret-file"):
        routing.router_config(missing, 8080)
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-a-mounted-secret-0123\n")
    env = {"CHATTTS_RESUME_SECRET_FILE": str(secret_file), "CHATTTS_RESUME_SECRET": "ignored-when-file-0123"}
    config = routing.router_config(load_settings(["--host", "10.1.2.3"], env=env), 8080)
    assert config is not None and config.key == b"from-a-mounted-secret-0123"
    assert config.advertise_url == "ws://10.1.2.3:8080"
    wildcard = load_settings(["--resume-secret", "x" * 16, "--host", "0.0.0.0"], env={})
    with pytest.raises(StartupError, match="--advertise-url: set it to ws://POD_IP:PORT"):
        routing.router_config(wildcard, 8080)
    pod = load_settings(["--resume-secret", "x" * 16, "--host", "0.0.0.0", "--advertise-url", HERE], env={})
    assert routing.router_config(pod, 8080).advertise_url == HERE  # type: ignore[union-attr]
    for bad in ("ws://pod.example:8080", "ws://10.1.2.3:8080/path", "ws://10.1.2.3:1" + "0" * 90):
        flags = ["--resume-secret", "x" * 16, "--advertise-url", bad]
        with pytest.raises(StartupError, match="--advertise-url"):
            routing.router_config(load_settings(flags, env={}), 8080)
    with pytest.raises(StartupError, match="--forward-allow: 'ten' is not a network"):
        routing.router_config(
            load_settings(["--resume-secret", "x" * 16, "--forward-allow", "ten"], env={}), 8080
        )


def test_loopback_owners_only_for_a_replica_on_loopback() -> None:
    everywhere = parse_networks("0.0.0.0/0")
    in_a_pod = Router(KEY, HERE, everywhere)
    token = Router(KEY, "ws://127.0.0.1:8080", everywhere).mint(REQUEST)
    claims = in_a_pod.verify(token)
    assert claims is not None and in_a_pod.forward_target(claims) is None  # its own pod, a sidecar
    on_one_host = Router(KEY, "ws://127.0.0.1:9090", everywhere)
    assert on_one_host.forward_target(claims) == "ws://127.0.0.1:8080"


def test_a_front_end_process_forwards_to_exactly_its_siblings() -> None:
    # --frontend-processes N: a child names its own loopback port; its siblings are admitted
    # whatever --forward-allow says, and no other loopback address is, even where the
    # networks hold 127.0.0.0/8 (the default): the operator's networks are not widened.
    flags = ["--resume-secret", "x" * 16, "--sibling-ports", "4001,4002,4003"]
    settings = load_settings(flags, env={})
    config = routing.router_config(settings, 8080)
    assert config is not None and config.advertise_url == "ws://127.0.0.1:4001"
    assert config.siblings == {"ws://127.0.0.1:4002", "ws://127.0.0.1:4003"}
    narrow = routing.router_config(load_settings([*flags, "--forward-allow", "10.0.0.0/8"], env={}), 8080)
    assert narrow is not None

    def target(config: routing.RouterConfig, owner: str) -> str | None:
        child = Router(config.key, config.advertise_url, config.allow, siblings=config.siblings)
        claims = child.verify(Router(config.key, owner, parse_networks("0.0.0.0/0")).mint(REQUEST))
        assert claims is not None
        return child.forward_target(claims)

    for c in (config, narrow):
        assert target(c, "ws://127.0.0.1:4002") == "ws://127.0.0.1:4002"
        assert target(c, "ws://127.0.0.1:4001") is None  # its own: regenerated or held here
        assert target(c, "ws://127.0.0.1:4004") is None  # loopback, but no sibling
        assert target(c, HERE) == HERE  # a replica inside --forward-allow, as before
    assert target(config, "ws://203.0.113.5:4002") is None  # outside --forward-allow, as before
    assert target(narrow, "ws://192.168.1.2:4002") is None
    for bad in ("4001", "4001,x", "0,4002", ""):
        with pytest.raises(StartupError, match="--sibling-ports"):
            routing.sibling_urls(dataclasses.replace(settings, sibling_ports=bad))
