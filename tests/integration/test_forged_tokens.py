"""A forged or tampered resume token is refused with ``unknown_stream`` and never makes a replica connect.

Each forged token names an address where a plain TCP listener counts the connections it
accepts; the replica the resume reaches must answer ``unknown_stream`` and the listener must
see nothing. The control case (a genuine token naming the listener) shows that the listener
does see the replica's connection when the replica forwards.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
from websockets.asyncio.client import connect

from server.app import App
from server.frontends.websocket.forward import FORWARD_HEADER
from server.streams.request import SpeechRequest
from server.streams.routing import Router, parse_networks
from tests.integration.conftest import MakeApp, wait_until
from tests.resumer import open_ws
from tests.wsclient import recv_json

SECRET = "forged-token-test-secret-0123456789"


class Listener:
    """A TCP listener that counts (and drops) the connections it gets."""

    def __init__(self) -> None:
        self.connections = 0
        self.port = 0

    def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        writer.transport.abort()


@asynccontextmanager
async def listening(host: str) -> AsyncIterator[Listener]:
    listener = Listener()
    server = await asyncio.start_server(listener.accept, host, 0)
    listener.port = server.sockets[0].getsockname()[1]
    try:
        yield listener
    finally:
        server.close()
        await server.wait_closed()


def b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).rstrip(b"=").decode()


def genuine(owner: str, key: str = SECRET) -> str:
    """A token signed with ``key`` that names ``owner``."""
    router = Router(key.encode(), owner, parse_networks("0.0.0.0/0"))
    return router.mint(SpeechRequest(name="s", text="Hi.", seed=1))


def with_owner(token: str, owner: str) -> str:
    """``token`` with its owner part replaced (the signature left as it was)."""
    parts = token.split(".")
    parts[-4] = b64(owner)
    return ".".join(parts)


def flip_last(token: str) -> str:
    return token[:-1] + ("A" if token[-1] != "A" else "B")


async def resume_answer(app: App, token: str) -> dict[str, object]:
    ws = await open_ws(app.port)
    await ws.send(json.dumps({"type": "resume", "stream": token, "after_seq": 3}))
    answer = await recv_json(ws)
    await ws.close()
    return answer


Forge = Callable[[str, str], str]  # (a real replica's token, the listener's URL) → forged token
FORGERIES: dict[str, Forge] = {
    "the owner changed to another address": lambda real, target: with_owner(real, target),
    "a changed signature": lambda real, target: flip_last(genuine(target)),
    "signed with another key": lambda real, target: genuine(target, key="another-deployment-key-42"),
    "the signature of another token": lambda real, target: (
        genuine(target).rpartition(".")[0] + "." + real.rpartition(".")[2]
    ),
    "no signature at all": lambda real, target: genuine(target).rpartition(".")[0],
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
async def test_a_forged_token_is_unknown_and_nothing_is_connected_to(make_app: MakeApp, forgery: str) -> None:
    a = await make_app("--resume-secret", SECRET)
    b = await make_app("--resume-secret", SECRET)
    ws = await open_ws(a.port)
    await ws.send(json.dumps({"type": "start", "id": "s", "text": "A real stream.", "seed": 1}))
    real = (await recv_json(ws))["stream"]
    await ws.close()
    async with listening("127.0.0.1") as listener:
        target = f"ws://127.0.0.1:{listener.port}"
        token = FORGERIES[forgery](real, target)
        answer = await resume_answer(b, token)
        assert answer["code"] == "unknown_stream" and answer["stream"] == token
        assert listener.connections == 0
        assert b.metrics.resumes.labels(how="unknown")._value.get() == 1


async def test_a_genuine_token_for_the_listener_does_connect_to_it(make_app: MakeApp) -> None:
    """The control: the listener sees a forward when the token is genuine (then the owner fails)."""
    b = await make_app("--resume-secret", SECRET, "--forward-timeout-s", "2")
    async with listening("127.0.0.1") as listener:
        answer = await resume_answer(b, genuine(f"ws://127.0.0.1:{listener.port}"))
        assert answer["code"] == "unknown_stream"  # no request with it: nothing to regenerate
        assert listener.connections == 1


async def test_a_signed_owner_outside_the_allowed_networks_is_never_connected_to(make_app: MakeApp) -> None:
    """Even a token signed with the key (a leaked key) cannot point a replica at a foreign host."""
    b = await make_app("--resume-secret", SECRET, "--forward-allow", "127.0.0.1/32")
    async with listening("127.0.0.2") as foreign:
        token = genuine(f"ws://127.0.0.2:{foreign.port}")
        answer = await resume_answer(b, token)
        assert answer["code"] == "unknown_stream" and answer["stream"] == token
        assert foreign.connections == 0


@pytest.mark.parametrize(
    "owner",
    ["ws://169.254.169.254:80", "http://127.0.0.1:9", "ws://localhost:80", "ws://127.0.0.1:80/path?x=1"],
)
async def test_owners_that_are_not_a_replica_address_are_refused(make_app: MakeApp, owner: str) -> None:
    """Cloud metadata (link-local), other schemes, names to resolve, paths: never forwarded to."""
    b = await make_app("--resume-secret", SECRET)
    answer = await resume_answer(b, genuine(owner))
    assert answer["code"] == "unknown_stream"
    await wait_until(lambda: b.metrics.forwarded_streams._value.get() == 0)
    assert b.metrics.resumes.labels(how="forwarded")._value.get() == 0


async def test_without_a_secret_tokens_are_opaque_and_resume_stays_local(make_app: MakeApp) -> None:
    a = await make_app()
    b = await make_app("--resume-secret", SECRET)
    ws = await open_ws(a.port)
    await ws.send(json.dumps({"type": "start", "id": "s", "text": "Local only.", "seed": 1}))
    started = await recv_json(ws)
    assert "." not in started["stream"] and len(started["stream"]) == 32  # as before signed tokens
    assert a.service.router is None
    await ws.close()
    assert (await resume_answer(b, started["stream"]))["code"] == "unknown_stream"
    assert (await resume_answer(a, genuine(f"ws://127.0.0.1:{b.port}")))["code"] == "unknown_stream"


async def test_a_forwarded_connection_is_never_forwarded_again(make_app: MakeApp) -> None:
    """The owner side of a forward: a resume arriving from a replica is served from here or refused."""
    b = await make_app("--resume-secret", SECRET)
    router = b.service.router
    assert router is not None
    async with listening("127.0.0.1") as listener:
        token = genuine(f"ws://127.0.0.1:{listener.port}")
        proof = router.peer_proof(token, time.time())
        ws = await connect(
            f"ws://127.0.0.1:{b.port}/v1/stream?resume={token}",
            additional_headers={FORWARD_HEADER: proof},
        )
        assert json.loads(await ws.recv())["type"] == "hello"
        await ws.send(json.dumps({"type": "resume", "stream": token, "after_seq": 0}))
        answer = json.loads(await ws.recv())
        await ws.close()
        assert answer["code"] == "unknown_stream" and listener.connections == 0
