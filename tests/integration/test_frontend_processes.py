"""``--frontend-processes 2``: one engine process, two ``serve`` children on the same port.

As a user runs it (``python -m server serve``): real sockets, real processes, the fake
engine. Which child serves a connection is read from the kernel (the child holding the
server's end of that TCP connection). Connections spread over both children and every
stream is byte-equal to the one-process form's; ``/metrics`` on either counts both; a child
killed with SIGKILL is started again and serves; SIGTERM drains both, exits 0 and leaves no
process. (A resume on the other child: test_frontend_resume.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from websockets.asyncio.client import ClientConnection

from tests.integration.conftest import MakeApp
from tests.integration.test_engine_process import children_of, gone
from tests.serverproc import free_port, http_status, spawn_server, wait_ready
from tests.wsclient import collect, open_client, recv_json, start, stream_payload

TEXT = "Two front ends, one engine. Each stream is its own."
SEEDS = (3, 4, 5, 6)
CONNECTIONS = 16  # all on one child by chance: 2 in 2**16
DEADLINE_S = 60.0


@dataclass
class Served:
    """The supervisor's process and its port."""

    proc: asyncio.subprocess.Process
    port: int

    def engine_host(self) -> int:
        (host,) = [pid for pid in children_of(self.proc.pid) if "server.core.remote.host" in _cmdline(pid)]
        return host

    def front_ends(self) -> set[int]:
        return {pid for pid in children_of(self.proc.pid) if "--engine-socket" in _cmdline(pid)}


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def holder(served: Served, ws: ClientConnection) -> int:
    """The child process holding the server's end of this client connection."""
    local_port = ws.local_address[1]
    for pid in served.front_ends():
        try:
            connections = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        if any(c.raddr and c.raddr.port == local_port and c.laddr.port == served.port for c in connections):
            return pid
    raise AssertionError(f"no front-end process holds the connection from port {local_port}")


@contextlib.asynccontextmanager
async def serve(*flags: str) -> AsyncIterator[Served]:
    """``serve --frontend-processes 2`` with these flags, ready; killed with all its children after."""
    port = free_port()
    voices = Path(tempfile.gettempdir()) / f"chattts-test-voices-{uuid.uuid4().hex}"
    proc = await spawn_server(
        *("--engine", "fake", "--port", str(port), "--frontend-processes", "2", "--voices-dir", str(voices)),
        *flags,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    served = Served(proc, port)
    try:
        await wait_ready(port, proc)
        async with asyncio.timeout(DEADLINE_S):  # both children listen (each binds before it is ready)
            while len(served.front_ends()) < 2:
                await asyncio.sleep(0.05)
        yield served
    finally:
        every = children_of(proc.pid) if proc.returncode is None else set()
        if proc.returncode is None:  # a drain (the supervisor removes its folder); killed past the deadline
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(DEADLINE_S):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        for pid in every:  # a failed test leaves nothing behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    async with serve("--resume-ttl-s", "30") as value:
        yield value


async def test_connections_spread_over_both_children_each_stream_byte_equal_and_metrics_count_both(
    make_app: MakeApp, served: Served
) -> None:
    one = await make_app()  # the one-process form
    reference = {seed: await stream_payload(one.port, text=TEXT, seed=seed) for seed in SEEDS}
    clients = [await open_client(served.port) for _ in range(CONNECTIONS)]
    holders = [holder(served, ws) for ws, _ in clients]
    assert len(set(holders)) == 2, "the kernel spreads connections over both children"
    for i, (ws, _) in enumerate(clients):
        await start(ws, id="s", text=TEXT, seed=SEEDS[i % len(SEEDS)])
    logs = await asyncio.gather(*(collect(ws, {"s"}) for ws, _ in clients))
    for i, log in enumerate(logs):
        assert log["s"].done is not None and log["s"].done["reason"] == "complete"
        assert log["s"].payload == reference[SEEDS[i % len(SEEDS)]]
    for ws, _ in clients:
        await ws.close()
    # Either child's /metrics is the merged view: the streams of both (neither served all 16).
    text = await asyncio.to_thread(_get, served.port, "/metrics")
    assert _value(text, 'chattts_streams_total{reason="complete"}') >= CONNECTIONS
    assert max(holders.count(pid) for pid in set(holders)) < CONNECTIONS
    assert _value(text, "chattts_tokens_generated_total") > 0  # the engine's counts, once


async def test_a_killed_child_is_restarted_and_new_connections_succeed(served: Served) -> None:
    before = served.front_ends()
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    async with asyncio.timeout(DEADLINE_S):
        while len(after := served.front_ends() - {victim}) < 2:
            await asyncio.sleep(0.05)
    (restarted,) = after - before
    # New connections succeed; once the new child listens, the kernel gives it some of them.
    async with asyncio.timeout(DEADLINE_S):
        while True:
            ws, _ = await open_client(served.port)
            await start(ws, id="s", text="After the crash.", seed=1)
            log = (await collect(ws, {"s"}))["s"]
            assert log.done is not None and log.done["reason"] == "complete"
            on = holder(served, ws)
            await ws.close()
            if on == restarted:
                break


async def test_sigterm_drains_both_children_exits_0_and_leaves_no_process() -> None:
    async with serve("--fake-step-ms", "20") as served:
        clients = [await open_client(served.port) for _ in range(8)]
        assert len({holder(served, ws) for ws, _ in clients}) == 2
        slots = []
        for ws, _ in clients:
            await start(ws, id="s", text=TEXT, seed=7)
            started = await recv_json(ws)
            assert started["type"] == "started"  # running on both children when the signal comes
            slots.append({started["slot"]: "s"})
        every = children_of(served.proc.pid)
        served.proc.send_signal(signal.SIGTERM)
        logs = await asyncio.gather(
            *(collect(ws, {"s"}, slot) for (ws, _), slot in zip(clients, slots, strict=True))
        )
        assert all(log["s"].done is not None and log["s"].done["reason"] == "complete" for log in logs)
        async with asyncio.timeout(DEADLINE_S):
            assert await served.proc.wait() == 0
        assert len(every) == 3 and all(gone(pid) for pid in every)


async def test_an_engine_process_that_dies_makes_the_children_not_ready_until_it_is_back(
    served: Served,
) -> None:
    host = served.engine_host()
    os.kill(host, signal.SIGKILL)
    async with asyncio.timeout(DEADLINE_S):
        while await asyncio.to_thread(http_status, served.port, "/ready") == 200:
            await asyncio.sleep(0.02)
    await wait_ready(served.port, served.proc)
    assert served.engine_host() != host
    ws, _ = await open_client(served.port)
    await start(ws, id="s", text="Back again.", seed=1)
    assert (await collect(ws, {"s"}))["s"].done is not None
    await ws.close()


async def finished(proc: asyncio.subprocess.Process) -> str:
    """Its stderr once it exits (within the deadline; killed with its children when it does not)."""
    try:
        async with asyncio.timeout(DEADLINE_S):
            _, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            for pid in children_of(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.kill()
            await proc.wait()
    return err.decode()


def _get(port: int, path: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        body: bytes = response.read()
    return body.decode()


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--frontend-processes", "0"), "--frontend-processes must be 1 or more"),
        (("--frontend-processes", "2", "--engine", "chattts"), "--engine-process runs only the fake engine"),
    ],
)
async def test_a_form_that_cannot_run_fails_the_start_with_one_line(
    flags: tuple[str, ...], message: str
) -> None:
    proc = await spawn_server(
        "--port", str(free_port()), *flags, env={**os.environ}, stderr=asyncio.subprocess.PIPE
    )
    err = await finished(proc)
    assert proc.returncode == 2 and message in err


async def test_a_child_that_cannot_start_stops_the_supervisor_with_its_error(tmp_path: Path) -> None:
    # The children read the keys file (the supervisor does not): every child fails the same way.
    missing = tmp_path / "no-such-keys"
    proc = await spawn_server(
        *("--engine", "fake", "--port", str(free_port()), "--frontend-processes", "2"),
        *("--api-keys-file", str(missing)),
        env={**os.environ},
        stderr=asyncio.subprocess.PIPE,
    )
    err = await finished(proc)
    assert proc.returncode == 2 and "--api-keys-file" in err
