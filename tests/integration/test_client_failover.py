"""The Python client resumes on whichever replica it reaches: forwarded, or regenerated (fake engine).

A :class:`CuttableProxy` stands in for a load balancer: after a cut it sends the reconnect to
another replica, and the client, which only knows the proxy, resumes there on its own.
"""

from __future__ import annotations

import asyncio

import pytest

import chattts_stream_client as cs
from tests.integration.conftest import MakeApp
from tests.resumer import unbroken
from tests.tcp_proxy import CuttableProxy

SECRET = "client-failover-test-secret-01234"
TEXT = "First sentence of the story. 第二句话在这里。And the third one ends it. A fourth, short."
REPLICA = ("--resume-secret", SECRET, "--cache-bytes", "0", "--fake-step-ms", "5")


def url(port: int) -> str:
    return f"ws://127.0.0.1:{port}/v1/stream"


async def speak_with_a_cut(
    proxy: CuttableProxy, cut_at: int, on_cut: object, *, seed: int | None, fmt: str
) -> tuple[cs.SpeechStream, bytes]:
    """Speak TEXT through ``proxy``, cut the connection after ``cut_at`` chunks, then ``await on_cut()``."""
    client = cs.Client(url(proxy.port), read_timeout=20, max_queued_chunks=2)
    chunks: list[bytes] = []
    async with client, asyncio.timeout(60):
        stream = client.speak(TEXT, seed=seed, format=fmt)
        async for chunk in stream:
            chunks.append(chunk.data)
            if len(chunks) == cut_at:
                proxy.blocked = True  # the reconnect waits until the balancer has another replica
                proxy.cut()
                await on_cut()  # type: ignore[operator]
                proxy.blocked = False
    return stream, b"".join(chunks)


@pytest.mark.parametrize("fmt", ["pcm16", "opus"])
async def test_the_client_resumes_through_another_replica(make_app: MakeApp, fmt: str) -> None:
    a, b = await make_app(*REPLICA), await make_app(*REPLICA)
    async with CuttableProxy(a.port) as proxy:

        async def balance_to_b() -> None:
            proxy.target_port = b.port

        stream, audio = await speak_with_a_cut(proxy, 6, balance_to_b, seed=9, fmt=fmt)
    expected = await unbroken(a.port, {"id": "ref", "text": TEXT, "seed": 9, "format": fmt})
    assert audio == expected.payload and stream.resumes == 1 and stream.duplicates >= 0
    assert b.metrics.resumes.labels(how="forwarded")._value.get() == 1


@pytest.mark.parametrize("fmt", ["pcm16", "opus"])
async def test_the_client_survives_the_death_of_its_replica(make_app: MakeApp, fmt: str) -> None:
    a, b = await make_app(*REPLICA), await make_app(*REPLICA)
    async with CuttableProxy(a.port) as proxy:

        async def kill_a() -> None:
            await a.stop()
            proxy.target_port = b.port

        # No seed asked: the server picks one and reports it, and the client keeps it.
        stream, audio = await speak_with_a_cut(proxy, 12, kill_a, seed=None, fmt=fmt)
    assert stream.seed is not None and stream.degraded is None
    expected = await unbroken(b.port, {"id": "ref", "text": TEXT, "seed": stream.seed, "format": fmt})
    assert audio == expected.payload
    assert b.metrics.resumes.labels(how="regenerated")._value.get() == 1
    assert stream.token is not None and b.service.registry.get(stream.token) is not None  # its new token


async def test_the_client_reports_a_degraded_resume(make_app: MakeApp) -> None:
    a = await make_app(*REPLICA)
    b = await make_app(*REPLICA, "--opus-bitrate", "20000")
    async with CuttableProxy(a.port) as proxy:

        async def kill_a() -> None:
            await a.stop()
            proxy.target_port = b.port

        stream, _ = await speak_with_a_cut(proxy, 8, kill_a, seed=3, fmt="opus")
    assert stream.done is not None and stream.done.reason == "complete"
    assert stream.degraded is not None and "differ" in stream.degraded
