from __future__ import annotations

import asyncio
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from server.app import App
from server.config import Settings, load_settings
from server.engine.fake import FakeEngine

MakeApp = Callable[..., Any]


def fake_engine(app: App) -> FakeEngine:
    """The app's engine, which these tests run as the fake one."""
    engine = app.engine_client.engine
    assert isinstance(engine, FakeEngine)
    return engine


async def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    """Wait (bounded) until ``predicate()`` holds."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def fake_settings(*flags: str) -> Settings:
    """Settings for an in-process fake-engine server on a free loopback port.

    Its voices folder is a fresh path (made only if the test uploads a voice), so no test
    reads voices another test or the user's cache left; ``--voices-dir`` in ``flags`` wins.
    """
    voices = Path(tempfile.gettempdir()) / f"chattts-test-voices-{uuid.uuid4().hex}"
    base = ["--engine", "fake", "--port", "0", "--host", "127.0.0.1", "--voices-dir", str(voices)]
    return load_settings([*base, *flags], env={})


@pytest.fixture
async def make_app() -> AsyncIterator[MakeApp]:
    """Start servers with extra flags; all are stopped at the end of the test."""
    apps: list[App] = []

    async def make(*flags: str, **kwargs: Any) -> App:
        app = App(fake_settings(*flags), **kwargs)
        await app.start()
        apps.append(app)
        return app

    yield make
    for app in apps:
        await app.stop()


@pytest.fixture
async def app(make_app: MakeApp) -> App:
    started: App = await make_app()
    return started
