"""Fixtures for engine tests on the tiny random-weight ChatTTS model (no network)."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.model.helpers import TEST_DEVICE

pytest.importorskip("ChatTTS")

if TEST_DEVICE.startswith("cuda"):
    import torch

    # The tests compare float32 results to 1e-4 or 1e-5: no TF32 shortcuts in matmuls and convolutions.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


class NetworkUsed(AssertionError):
    pass


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise NetworkUsed(f"network use attempted: {args!r}")


@contextmanager
def network_refused() -> Iterator[None]:
    """Fail any connect or DNS lookup (and set HF_HUB_OFFLINE) inside the block."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setattr(socket.socket, "connect", _refuse)
    mp.setattr(socket.socket, "connect_ex", _refuse)
    mp.setattr(socket, "getaddrinfo", _refuse)
    mp.setattr(socket, "create_connection", _refuse)
    try:
        yield
    finally:
        mp.undo()


_real_connect = socket.socket.connect
_real_getaddrinfo = socket.getaddrinfo


def _loopback_connect(sock: socket.socket, address: Any) -> Any:
    host = address[0] if isinstance(address, tuple) else None
    if host is None or not ipaddress.ip_address(host).is_loopback:
        raise NetworkUsed(f"network use attempted: {address!r}")
    return _real_connect(sock, address)


def _loopback_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
    if host not in ("127.0.0.1", "::1", "localhost", None):
        raise NetworkUsed(f"DNS lookup attempted: {host!r}")
    return _real_getaddrinfo(host, *args, **kwargs)


@contextmanager
def loopback_only() -> Iterator[None]:
    """Like :func:`network_refused`, but loopback connections (our own server) pass."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setattr(socket.socket, "connect", _loopback_connect)
    mp.setattr(socket, "getaddrinfo", _loopback_getaddrinfo)
    try:
        yield
    finally:
        mp.undo()


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
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from server.engine.chattts.devmodel import make_dev_model

    directory = tmp_path_factory.mktemp("tiny-chattts")
    with network_refused():
        make_dev_model("tiny", directory, seed=0)
    return directory


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
