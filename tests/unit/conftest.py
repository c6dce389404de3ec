"""Shared fixtures of the unit tests that need a service: a real one over the fake engine's thread."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from server.config import load_settings
from server.core.client import EngineClient
from server.core.factory import policy_config
from server.engine.fake import FakeEngine
from server.metrics import Metrics
from server.streams.service import SpeechService

MakeService = Callable[..., Any]


@pytest.fixture
async def make_service() -> AsyncIterator[MakeService]:
    """Services with extra flags over a live fake engine; all stopped at the end."""
    started: list[tuple[SpeechService, EngineClient]] = []

    async def make(*flags: str) -> SpeechService:
        settings = load_settings(["--engine", "fake", "--no-warmup", *flags], env={})
        metrics = Metrics()
        client = EngineClient(FakeEngine, config=policy_config(settings), metrics=metrics, warmup=False)
        await client.start()
        service = SpeechService(settings, client, metrics)
        started.append((service, client))
        return service

    yield make
    for service, client in started:
        await service.stop()
        await client.stop()
