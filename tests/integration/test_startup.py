"""A start-up that cannot succeed: one line naming the cause and the flag, exit code 2, nothing left.

As a user runs it (a ``serve`` subprocess): no traceback, no abort (``terminate
called ...``), and in-process no thread outlives the failed start.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from pathlib import Path

import pytest

from server.app import App
from server.engine.fake import FakeEngine
from server.errors import StartupError
from tests.integration.conftest import fake_settings
from tests.serverproc import free_port, spawn_server


async def failed_start(*flags: str) -> tuple[int, list[str]]:
    """Run ``serve`` with ``flags`` until it exits (30 s at most): its code and stderr lines."""
    proc = await spawn_server(
        "--engine", "fake", "--host", "127.0.0.1", *flags,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(30):
            _, stderr = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, stderr.decode().splitlines()


def assert_one_line(code: int, lines: list[str], *fragments: str) -> None:
    text = "\n".join(lines)
    assert code == 2, text  # not -6: no abort
    assert "Traceback" not in text and "terminate called" not in text, text
    ours = [line for line in lines if line.startswith("chattts-stream: ")]
    assert len(ours) == 1 and ours[0] == lines[-1], text
    for fragment in fragments:
        assert fragment in ours[0], text


def listening_socket() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


async def test_websocket_port_in_use() -> None:
    blocker, port = listening_socket()
    with blocker:
        code, lines = await failed_start("--port", str(port))
    assert_one_line(code, lines, f"127.0.0.1:{port}", "(--port)", "in use")


async def test_neighbouring_servers_collide_on_an_explicit_http_port() -> None:
    # Server A listens on P; server B is told to put its HTTP API on P.
    blocker, port = listening_socket()
    with blocker:
        code, lines = await failed_start("--port", str(free_port()), "--http-port", str(port))
    assert_one_line(code, lines, f"127.0.0.1:{port}", "(--http-port)")


async def test_unreadable_api_keys_file(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-keys.txt"
    code, lines = await failed_start("--port", str(free_port()), "--api-keys-file", str(missing))
    assert_one_line(code, lines, "--api-keys-file", str(missing), "No such file")
    code, lines = await failed_start("--port", str(free_port()), "--api-keys-file", str(tmp_path))
    assert_one_line(code, lines, "--api-keys-file", "Is a directory")


def inference_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name in ("inference",) or t.name.startswith("encode")]


async def test_a_failed_start_leaves_no_thread_and_frees_its_ports() -> None:
    def broken() -> FakeEngine:
        raise RuntimeError("weights are\ncorrupt")

    before = inference_threads()
    port = free_port()
    app = App(fake_settings("--port", str(port)), engine_factory=broken)
    with pytest.raises(StartupError) as failed:
        await app.start()
    assert str(failed.value) == "the engine failed to load (--engine): RuntimeError: weights are corrupt"
    assert inference_threads() == before
    # The ports it had bound are free again: a working server can take them at once.
    again = App(fake_settings("--port", str(port)))
    await again.start()
    try:
        assert again.port == port
    finally:
        await again.stop()
    assert inference_threads() == before
