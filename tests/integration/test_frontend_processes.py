"""``--frontend-processes 2``: one engine process, two ``serve`` children on the same port.

As a user runs it (``python -m server serve``): real sockets, real processes, the fake
engine. Which child serves a connection is read from the kernel (the child holding the
server's end of that TCP connection). Connections spread over both children and every
stream is byte-equal to the one-process form's; ``/metrics`` on either counts both; a child
killed with SIGKILL is started again and serves; SIGTERM drains both, exits 0 and leaves no
process; the children run at a lower CPU priority than the engine process. (A resume on the
other child: test_frontend_resume.py.)
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

from server.cli import LOWER_NICE
from server.engine_api import EngineInfo
from server.supervisor import frontend_priority
from tests.integration.conftest import MakeApp
from tests.integration.test_engine_process import children_of, gone
from tests.serverproc import free_port, spawn_server, wait_ready
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
    pid = holder_of(served, local_port)
    if pid is None:
        raise AssertionError(f"no front-end process holds the connection from port {local_port}")
    return pid


def holder_of(served: Served, local_port: int) -> int | None:
    """The child that accepted the TCP connection from ``local_port`` (None: none has yet)."""
    for pid in served.front_ends():
        try:
            connections = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        if any(c.raddr and c.raddr.port == local_port and c.laddr.port == served.port for c in connections):
            return pid
    return None


async def ready_status(served: Served, pid: int) -> int:
    """``/ready``'s status on the child ``pid`` itself (not on whichever child the kernel picks).

    A connection is opened until one lands on that child: the request's first line goes out, so
    the child accepts it and waits for the headers; the kernel then says who holds it, and the
    rest of the request is sent on the connection that child holds.
    """
    while True:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        try:
            writer.write(b"GET /ready HTTP/1.1\r\n")
            await writer.drain()
            local_port = writer.get_extra_info("sockname")[1]
            while (on := holder_of(served, local_port)) is None:  # accepted soon: polled, nothing to wait on
                await asyncio.sleep(0.01)
            if on == pid:
                writer.write(b"Host: 127.0.0.1\r\nConnection: close\r\n\r\n")
                await writer.drain()
                status_line = await reader.readline()
                return int(status_line.split()[1])
        finally:
            writer.close()


async def every_child_ready(served: Served) -> None:
    """Until both children answer ``/ready`` 200 themselves (a child may listen before it is ready)."""
    async with asyncio.timeout(DEADLINE_S):
        while len(children := served.front_ends()) < 2:  # both started (each binds before it is ready)
            await asyncio.sleep(0.05)
        for pid in children:
            while await ready_status(served, pid) != 200:
                await asyncio.sleep(0.05)


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
        await every_child_ready(served)
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
    # The supervisor is held stopped while the engine host dies, so that no new one starts
    # until both children were seen not ready: nothing here races the restart.
    served.proc.send_signal(signal.SIGSTOP)
    try:
        os.kill(host, signal.SIGKILL)
        async with asyncio.timeout(DEADLINE_S):
            for pid in served.front_ends():
                while await ready_status(served, pid) == 200:  # until it has read the end of the socket
                    await asyncio.sleep(0.02)
    finally:
        served.proc.send_signal(signal.SIGCONT)
    await every_child_ready(served)  # each reconnects on its own: /ready on one says nothing of the other
    assert served.engine_host() != host
    ws, _ = await open_client(served.port)
    await start(ws, id="s", text="Back again.", seed=1)
    assert (await collect(ws, {"s"}))["s"].done is not None
    await ws.close()


def thread_policy(pid: int) -> set[int]:
    """The scheduling policies of every thread of ``pid``."""
    values = set()
    for thread in psutil.Process(pid).threads():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            values.add(os.sched_getscheduler(thread.id))
    return values


def thread_nice(pid: int) -> set[int]:
    """The nice values of every thread of ``pid`` (Linux: a thread's priority is its own)."""
    values = set()
    for thread in psutil.Process(pid).threads():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            values.add(os.getpriority(os.PRIO_PROCESS, thread.id))
    return values


async def busy_children(served: Served) -> None:
    """One Opus stream on a child, so that its threads (event loop, encoder pool) are running."""
    ws, _ = await open_client(served.port)
    await start(ws, id="s", text=TEXT, seed=1, format="opus")
    assert (await collect(ws, {"s"}))["s"].done is not None
    await ws.close()


async def test_the_children_run_only_on_what_the_engine_process_leaves(served: Served) -> None:
    # So that the engine's host work wins a core from front ends that keep every core busy
    # (bench/results/studies/frontend-priority-<hw>.md): the default (auto) for an engine whose
    # model is not on the CPU. Every thread of a child, the encoder pool's and the event
    # loop's alike; the engine process keeps ours.
    await busy_children(served)
    assert thread_policy(served.engine_host()) == {os.sched_getscheduler(0)}
    for pid in served.front_ends():
        assert thread_policy(pid) == {os.SCHED_IDLE}


async def test_lower_children_run_ten_nice_steps_below_the_engine_process() -> None:
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    async with serve("--frontend-priority", "lower") as served:
        await busy_children(served)
        assert thread_nice(served.engine_host()) == {ours}
        for pid in served.front_ends():
            assert thread_nice(pid) == {min(19, ours + LOWER_NICE)}


@pytest.mark.parametrize(
    ("choice", "device", "children"),
    [("auto", "cpu", "lower"), ("auto", "cuda:0", "idle"), ("auto", None, "idle"), ("same", "cuda", "same")],
)
def test_auto_picks_the_children_s_priority_by_where_the_model_runs(
    choice: str, device: str | None, children: str
) -> None:
    # A model on the CPU wants every core for its own threads: idle children would get none.
    info = EngineInfo(name="x", extra={} if device is None else {"device": device})
    assert frontend_priority(choice, info) == children


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
        (("--frontend-processes", "2", "--frontend-priority", "high"), "--frontend-priority: invalid choice"),
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
