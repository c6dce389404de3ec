"""Fixtures for engine tests on the tiny random-weight ChatTTS model (no network).

Every test collected under this folder is marked ``model`` (``-m "not model"`` leaves them out).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.model.helpers import TEST_DEVICE
from tests.netguard import loopback_only, network_refused

pytest.importorskip("ChatTTS")

if TEST_DEVICE.startswith("cuda"):
    import torch

    # The tests compare float32 results to 1e-4 or 1e-5: no TF32 shortcuts in matmuls and convolutions.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest's hooks see the whole session's items: mark only this folder's.
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.model)


@pytest.fixture(autouse=True)
def _no_network_in_model_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    """Engine tests get no network at all; tests marked ``loopback`` may talk to their own server."""
    if request.node.get_closest_marker("loopback") is not None:
        with loopback_only():
            yield
        return
    with network_refused():
        yield


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path) -> Iterator[Any]:
    """One fp32 engine for the session (fp32: the in-batch determinism test needs it)."""
    from server.engine.chattts.engine import ChatTTSEngine

    with network_refused():
        engine = ChatTTSEngine.load(model_dir=tiny_model_dir, device=TEST_DEVICE, dtype="float32")
        engine.warmup()
    yield engine
    engine.close()


@pytest.fixture
async def make_model_app(tiny_model_dir: Path) -> AsyncIterator[Callable[..., Any]]:
    """Start servers on the tiny model with extra flags; each is stopped at the end of the test.

    ``prepare`` is called with the engine on the inference thread, before its warm-up (tests
    put stand-ins on it there, such as a fixed refiner).
    """
    from server.app import App
    from server.config import load_settings
    from server.engine.loading import chattts_engine_factory

    apps: list[App] = []

    async def make(*flags: str, prepare: Callable[[Any], None] | None = None) -> App:
        base = ["--engine", "chattts", "--model-dir", str(tiny_model_dir), "--device", TEST_DEVICE]
        base += ["--dtype", "float32", "--host", "127.0.0.1", "--port", "0", "--cache-bytes", "0"]
        base += ["--profile", "eager"]  # not the default's minutes of compiling (tests/conftest.py)
        settings = load_settings([*base, *flags], env={})
        build = chattts_engine_factory(settings)

        def factory() -> Any:
            engine = build()
            if prepare is not None:
                prepare(engine)
            return engine

        app = App(settings, engine_factory=factory)
        await app.start()
        apps.append(app)
        await app.warmed_up.wait()
        return app

    yield make
    for app in apps:
        await app.stop()
