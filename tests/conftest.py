"""Shared fixtures: every async test runs on uvloop, like the server; the tiny model's folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import uvloop

from tests.netguard import network_refused


def pytest_asyncio_loop_factories(config: Any, item: Any) -> dict[str, Any]:
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight ChatTTS model, written once per session (tests/model and tests/bench)."""
    pytest.importorskip("ChatTTS")
    from server.engine.chattts.devmodel import make_dev_model

    directory = tmp_path_factory.mktemp("tiny-chattts")
    with network_refused():
        make_dev_model("tiny", directory, seed=0)
    return directory
