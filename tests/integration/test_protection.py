"""Rate limits, connection caps, API keys, origins and the response cache over real sockets."""

from __future__ import annotations

import json
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from server.engine.fake import FakeEngine
from tests.wsclient import collect, open_client, recv, start, url


async def closed_with(port: int, path_suffix: str = "", **kwargs: Any) -> int | None:
    ws = await connect(url(port) + path_suffix, compression=None, **kwargs)
    with pytest.raises(ConnectionClosed) as closed:
        await recv(ws)
    return closed.value.rcvd.code if closed.value.rcvd else None


@pytest.mark.parametrize("keys", [False, True], ids=["by IP", "by API key"])
async def test_rate_limited_with_retry_after(make_app: Any, keys: bool) -> None:
    flags = ["--rate-limit-per-min", "6", "--rate-limit-burst", "2", "--max-streams", "8"]
    app = await make_app(*flags, *(["--api-keys", "key-one,key-two"] if keys else []))
    ws, _ = await open_client(app.port, additional_headers={"X-API-Key": "key-one"})
    for i in range(2):
        await start(ws, id=f"s{i}", text="Allowed.", seed=i)
    await start(ws, id="s2", text="One too many.", seed=2)
    logs = await collect(ws, {"s0", "s1", "s2"})
    assert logs["s0"].done and logs["s1"].done
    [err] = logs["s2"].errors
    assert err["code"] == "rate_limited" and 9000 <= err["retry_after_ms"] <= 10000
    other, _ = await open_client(app.port, additional_headers={"X-API-Key": "key-two"})
    await start(other, id="x", text="Fine.", seed=1)
    log = (await collect(other, {"x"}))["x"]
    if keys:  # a different client (another API key) is not limited by this one
        assert log.done is not None
    else:  # without keys a key is any string a client picks: the same IP is the same client
        assert [e["code"] for e in log.errors] == ["rate_limited"]
    await ws.close()
    await other.close()


async def test_connection_cap_per_client_closes_with_1013(make_app: Any) -> None:
    app = await make_app("--max-connections-per-client", "2")
    first, _ = await open_client(app.port)
    second, _ = await open_client(app.port)
    assert await closed_with(app.port) == 1013
    await first.close()
    third, _ = await open_client(app.port)  # room again
    await third.close()
    await second.close()


async def test_api_keys_close_with_1008_and_are_never_logged(
    make_app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG", logger="server")
    app = await make_app("--api-keys", "secret-key-1,secret-key-2")
    assert await closed_with(app.port) == 1008
    assert await closed_with(app.port, additional_headers={"Authorization": "Bearer wrong"}) == 1008
    ws, _ = await open_client(app.port, additional_headers={"Authorization": "Bearer secret-key-2"})
    await ws.close()
    browser = await connect(url(app.port) + "?api_key=secret-key-1", compression=None)
    assert json.loads(await recv(browser))["type"] == "hello"
    await browser.close()
    assert "secret-key" not in caplog.text


async def test_bad_origin_closes_with_1008(make_app: Any) -> None:
    app = await make_app("--allowed-origins", "https://app.example")
    assert await closed_with(app.port, origin="https://evil.example") == 1008
    ws, _ = await open_client(app.port, origin="https://app.example")
    await ws.close()


@pytest.mark.parametrize("fmt", ["pcm16", "opus"])
async def test_cache_hit_returns_identical_bytes_without_the_model(make_app: Any, fmt: str) -> None:
    app = await make_app("--fake-step-ms", "20")
    engine = app.engine_client.engine
    assert isinstance(engine, FakeEngine)
    await app.warmed_up.wait()  # warm-up steps after the first stream would count as model work
    request = {"text": "Cached sentence one. 第二句。", "seed": 5, "voice": "alto", "format": fmt}
    ws, _ = await open_client(app.port)
    await start(ws, id="a", **request)
    first = (await collect(ws, {"a"}))["a"]
    steps_before = len(engine.steps)
    await start(ws, id="b", **request)
    second = (await collect(ws, {"b"}))["b"]
    # No engine step ran for the second stream: every frame came from the cache at once.
    assert len(engine.steps) == steps_before
    assert second.payload == first.payload
    assert [f.header for f in second.frames] == [f.header for f in first.frames]
    assert [s["text"] for s in second.segments] == [s["text"] for s in first.segments]
    assert second.done is not None and second.done["id"] == "b"
    assert second.done["samples"] == first.done["samples"]  # type: ignore[index]
    # Any change to what shapes the audio misses the cache.
    await start(ws, id="c", **{**request, "seed": 6})
    third = (await collect(ws, {"c"}))["c"]
    assert len(engine.steps) > steps_before and third.payload != first.payload
    metrics = app.metrics.render().decode()
    assert "chattts_cache_hits_total 1.0" in metrics and "chattts_cache_misses_total 2.0" in metrics
    await ws.close()


async def test_unseeded_requests_are_not_cached(app: Any) -> None:
    ws, _ = await open_client(app.port)
    for sid in ("a", "b"):
        await start(ws, id=sid, text="No seed here.")
        await collect(ws, {sid})
    assert "chattts_cache_hits_total 0.0" in app.metrics.render().decode()
    await ws.close()


async def test_rate_limit_per_forwarded_client_behind_a_proxy(make_app: Any) -> None:
    app = await make_app("--rate-limit-per-min", "1", "--rate-limit-burst", "1", "--trust-forwarded-for")
    for ip in ("198.51.100.1", "198.51.100.2"):  # two clients behind the same proxy
        ws, _ = await open_client(app.port, additional_headers={"X-Forwarded-For": ip})
        await start(ws, id="a", text="First is free.", seed=1)
        await start(ws, id="b", text="Second is limited.", seed=2)
        logs = await collect(ws, {"a", "b"})
        assert logs["a"].done is not None and not logs["a"].errors
        assert [e["code"] for e in logs["b"].errors] == ["rate_limited"]
        await ws.close()


async def test_opus_bitrate_is_configurable(make_app: Any) -> None:
    sizes = []
    for bitrate in ("16000", "64000"):
        app = await make_app("--opus-bitrate", bitrate, "--cache-bytes", "0")
        ws, _ = await open_client(app.port)
        await start(ws, id="o", text="The same sentence at two bitrates.", seed=1, format="opus")
        sizes.append(len((await collect(ws, {"o"}))["o"].payload))
        await ws.close()
    assert sizes[1] > 2 * sizes[0]
