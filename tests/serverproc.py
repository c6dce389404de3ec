"""The server as a user runs it: a ``python -m server serve`` subprocess, and probes for it."""

from __future__ import annotations

import asyncio
import random
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A loopback TCP port nothing uses right now, and the next one free too.

    A server started with only ``--port`` serves HTTP on ``--port + 1``, so both must be
    free. The port is drawn below the kernel's ephemeral range: a port the kernel hands out
    (``bind(0)``, every outgoing connection's local end) can be taken by another client
    between this check and the server's bind, which made a CI run's HTTP port busy.
    """
    low, high = _ports_below_ephemeral()
    for _ in range(200):
        port = random.randint(low, high - 1)
        if _bindable(port) and _bindable(port + 1):
            return port
    raise RuntimeError(f"no two free loopback ports in {low}-{high}")


def _ports_below_ephemeral() -> tuple[int, int]:
    """A range of ports the kernel never picks for ``bind(0)`` or outgoing connections."""
    try:
        first_ephemeral = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768  # Linux's default; macOS starts at 49152
    return max(1024, first_ephemeral - 12000), first_ephemeral - 1


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


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
    profile: str | None = "eager",
) -> asyncio.subprocess.Process:
    """Start ``python -m server serve FLAGS`` with ``env``; the caller owns (and reaps) the process.

    ``preexec_fn`` runs in the child before the server starts (a lower open-files limit).
    ``profile``: the ``CHATTTS_PROFILE`` it runs under, unless ``env`` names one: ``eager``, so
    that a ChatTTS server is ready in seconds instead of compiling its CPU step for minutes;
    ``None``: none set, the server's default (the one test of the default passes it).
    """
    env = dict(env)
    if profile is None:
        env.pop("CHATTTS_PROFILE", None)
    else:
        env.setdefault("CHATTTS_PROFILE", profile)
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "server",
        "serve",
        *flags,
        env=env,
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
