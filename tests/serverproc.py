"""The server as a user runs it: a ``python -m server serve`` subprocess, and probes for it."""

from __future__ import annotations

import asyncio
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def http_status(port: int, path: str) -> int:
    """The status of ``GET path`` on the loopback server (blocking: call it in a thread)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code


async def spawn_server(
    *flags: str,
    env: Mapping[str, str],
    stdout: int | None = None,
    stderr: int | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> asyncio.subprocess.Process:
    """Start ``python -m server serve FLAGS`` with ``env``; the caller owns (and reaps) the process.

    ``preexec_fn`` runs in the child before the server starts (a lower open-files limit).
    """
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "server",
        "serve",
        *flags,
        env=dict(env),
        stdout=stdout,
        stderr=stderr,
        preexec_fn=preexec_fn,
    )


async def wait_ready(port: int, proc: asyncio.subprocess.Process, timeout_s: float = 60) -> None:
    """Poll ``/ready`` until 200 (``timeout_s`` at most); fail at once if the server exits."""
    async with asyncio.timeout(timeout_s):
        while True:
            assert proc.returncode is None, "server exited during start-up"
            try:
                if await asyncio.to_thread(http_status, port, "/ready") == 200:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.1)
