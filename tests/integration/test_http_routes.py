"""Health, readiness (after warm-up), metrics and static routes on the WebSocket port."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from typing import Any

from server.app import App
from server.core.warmup import PHASES, WARMUP_TEXTS
from server.engine.fake import FakeEngine
from tests.integration.conftest import fake_settings


def get(port: int, path: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


async def test_ready_waits_for_warm_up_through_the_real_path() -> None:
    engine = FakeEngine(step_base_s=0.05, step_per_row_s=0.0)
    app = App(fake_settings("--warmup"), engine_factory=lambda: engine)
    await app.start()
    try:
        status, _, _ = await asyncio.to_thread(get, app.port, "/ready")
        assert status == 503  # warm-up is still running
        assert (await asyncio.to_thread(get, app.port, "/health"))[0] == 200
        async with asyncio.timeout(30):
            await app.warmed_up.wait()
        assert (await asyncio.to_thread(get, app.port, "/ready"))[0] == 200
        # Every warm-up text went through the scheduler, each phase's batched together.
        segments = sum(len(WARMUP_TEXTS[number]) for phase in PHASES for number in phase)
        assert sum(1 for kind, _ in engine.events if kind == "finish") == segments
        assert max(len(step.seq_ids) for step in engine.steps) >= max(len(phase) for phase in PHASES)
    finally:
        await app.stop()


async def test_metrics_and_unknown_paths(app: App) -> None:
    status, content_type, body = await asyncio.to_thread(get, app.port, "/metrics")
    assert status == 200 and content_type.startswith("text/plain")
    for name in (
        "chattts_connections",
        "chattts_active_streams",
        "chattts_queue_depth",
        "chattts_frames_sent_total",
        "chattts_time_to_first_audio_seconds_bucket",
        "chattts_batch_size_bucket",
        "chattts_block_seconds_bucket",
    ):
        assert name.encode() in body
    assert (await asyncio.to_thread(get, app.port, "/nope"))[0] == 404
    assert (await asyncio.to_thread(get, app.port, "/client_js/../pyproject.toml"))[0] == 404


async def test_health_fails_when_the_inference_thread_is_gone(make_app: Any) -> None:
    app = await make_app()
    await app.engine_client.stop()
    assert (await asyncio.to_thread(get, app.port, "/health"))[0] == 503
    assert (await asyncio.to_thread(get, app.port, "/ready"))[0] == 503


async def test_breaker_fails_ready_until_a_probe_succeeds(make_app: Any) -> None:
    from tests.wsclient import collect, open_client, start

    app = await make_app("--breaker-probe-s", "0.2")
    await app.warmed_up.wait()
    engine = app.engine_client.engine
    assert isinstance(engine, FakeEngine)
    engine.failures.fail_steps = 5  # the default breaker threshold
    ws, _ = await open_client(app.port)
    for i in range(5):
        await start(ws, id=f"f{i}", text="This step fails.", seed=i)
        log = (await collect(ws, {f"f{i}"}))[f"f{i}"]
        assert [e["code"] for e in log.errors] == ["engine_error"]
        assert log.done is not None and log.done["reason"] == "error"
    assert (await asyncio.to_thread(get, app.port, "/ready"))[0] == 503
    # Meanwhile new streams are refused at once, with a hint when to retry.
    await start(ws, id="wait", text="Refused.", seed=1)
    refused = (await collect(ws, {"wait"}))["wait"]
    assert [e["code"] for e in refused.errors] == ["overloaded"] and refused.errors[0]["retry_after_ms"] > 0
    async with asyncio.timeout(30):
        while (await asyncio.to_thread(get, app.port, "/ready"))[0] != 200:
            await asyncio.sleep(0.1)
    await start(ws, id="ok", text="Recovered.", seed=1)
    assert (await collect(ws, {"ok"}))["ok"].done["reason"] == "complete"  # type: ignore[index]
    await ws.close()
