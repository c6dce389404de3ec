"""``--frontend-processes 2``: a resume finds its stream on whichever child it lands on.

Real processes and sockets, the fake engine. Each child also listens on a loopback port of
its own (``--sibling-ports``) and its tokens, signed with the key the supervisor made, name
that port; the child a resume lands on forwards it there (``forward.py``), or regenerates
the stream exactly when its owner is gone (``failover.py``). Which child holds a connection
is read from the kernel (``holder``); a test that needs a given child opens connections
until one lands there. Every stream is compared with an uncut stream byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import InvalidHandshake

import chattts_stream_client as cs
from tests.cluster import Cluster, Replica
from tests.integration.test_cluster import FLAGS, Hook, cut_points, play, references
from tests.integration.test_engine_process import children_of
from tests.integration.test_frontend_processes import DEADLINE_S, Served, _cmdline, finished, holder, serve
from tests.resumer import Taken, open_ws, take, unbroken
from tests.serverproc import free_port, http_status, spawn_server
from tests.tcp_proxy import CuttableProxy

pytestmark = pytest.mark.timeout(300)

TEXT = "A stream that outlives its front-end process. It is resumed on the other one, byte for byte."
START = {"id": "s", "text": TEXT, "seed": 11}
#: No response cache: every stream is generated (a cached one would not be running when its
#: owner is killed or drained).
NO_CACHE = ("--cache-bytes", "0")


def sibling_port(pid: int) -> int | None:
    """A child's own loopback port (the first of its ``--sibling-ports``)."""
    words = _cmdline(pid).split()
    if "--sibling-ports" not in words:
        return None
    return int(words[words.index("--sibling-ports") + 1].split(",")[0])


def children(served: Served) -> dict[int, int]:
    """pid → loopback port of every child now running."""
    return {pid: port for pid in served.front_ends() if (port := sibling_port(pid)) is not None}


@contextlib.asynccontextmanager
async def host(*flags: str) -> AsyncIterator[Served]:
    """A supervisor with 2 children, each of them ready (asked on its own loopback port)."""
    async with serve(*flags) as served:
        async with asyncio.timeout(DEADLINE_S):
            while True:
                ports = list(children(served).values())
                statuses = await asyncio.gather(*(_status(port) for port in ports))
                if len(ports) == 2 and all(status == 200 for status in statuses):
                    break
                await asyncio.sleep(0.1)
        yield served


async def _status(port: int) -> int:
    try:
        return await asyncio.to_thread(http_status, port, "/ready")
    except OSError:
        return 0


async def connection_on(served: Served, pid: int, token: str | None = None) -> ClientConnection:
    """A connection held by child ``pid`` (others are opened and closed until one lands there).

    A draining child refuses new connections (503): the kernel may still hand it some.
    """
    async with asyncio.timeout(DEADLINE_S):
        while True:
            try:
                ws = await open_ws(served.port, token)
            except (InvalidHandshake, OSError):  # refused while draining; reset by a child just killed
                continue
            if holder(served, ws) == pid:
                return ws
            await ws.close()


def resumes(port: int, how: str) -> float:
    """``chattts_resumes_total{how=...}`` over every child (blocking): the merged ``/metrics``,
    asked on a given child's loopback port (a child being killed may reset a public connection)."""
    return Replica(port, Path(os.devnull)).metric("chattts_resumes_total", f'how="{how}"')


async def test_a_resume_on_the_other_child_gets_the_stream_byte_equal() -> None:
    async with host(*NO_CACHE, "--fake-step-ms", "40") as served:
        expected = await unbroken(served.port, START)
        ws = await open_ws(served.port)
        owner = holder(served, ws)
        ((other, port),) = {pid: port for pid, port in children(served).items() if pid != owner}.items()
        taken = Taken(START)
        await ws.send(json.dumps({"type": "start", **START}))
        assert await take(ws, taken, cut_after=5) == "cut"
        before = await asyncio.to_thread(resumes, port, "forwarded")
        elsewhere = await connection_on(served, other, taken.token)
        await elsewhere.send(json.dumps(taken.resume(with_request=False)))  # forwarded: no request needed
        assert await take(elsewhere, taken) == "done"
        await elsewhere.close()
        assert await asyncio.to_thread(resumes, port, "forwarded") == before + 1
    assert taken.frames == expected.frames and taken.payload == expected.payload


async def test_the_owner_killed_with_sigkill_its_stream_is_regenerated_on_the_other_byte_equal() -> None:
    async with host(*NO_CACHE, "--fake-step-ms", "150") as served:
        expected = await unbroken(served.port, START)
        ws = await open_ws(served.port)
        owner = holder(served, ws)
        ((survivor, port),) = {pid: port for pid, port in children(served).items() if pid != owner}.items()
        taken = Taken(START)
        await ws.send(json.dumps({"type": "start", **START}))
        assert await take(ws, taken, pause_after=5) == "paused"
        before = await asyncio.to_thread(resumes, port, "regenerated")
        os.kill(owner, signal.SIGKILL)
        ws.transport.abort()
        elsewhere = await connection_on(served, survivor, taken.token)
        await elsewhere.send(json.dumps(taken.resume()))  # with the request: the owner may be gone
        assert await take(elsewhere, taken) == "done"
        await elsewhere.close()
        assert await asyncio.to_thread(resumes, port, "regenerated") == before + 1
    assert taken.frames == expected.frames and taken.payload == expected.payload


async def test_a_child_started_again_in_the_killed_owners_slot_regenerates_its_stream_byte_equal() -> None:
    # The slot keeps its loopback port (the supervisor holds it), so the new child takes the
    # dead one's tokens as its own.
    async with host(*NO_CACHE, "--fake-step-ms", "150") as served:
        expected = await unbroken(served.port, START)
        ws = await open_ws(served.port)
        owner = holder(served, ws)
        slot_port = children(served)[owner]
        taken = Taken(START)
        await ws.send(json.dumps({"type": "start", **START}))
        assert await take(ws, taken, pause_after=5) == "paused"
        os.kill(owner, signal.SIGKILL)
        ws.transport.abort()
        async with asyncio.timeout(DEADLINE_S):
            while True:  # the new child in the slot, ready
                new = [pid for pid, port in children(served).items() if port == slot_port and pid != owner]
                if new and await _status(slot_port) == 200:
                    break
                await asyncio.sleep(0.05)
        before = await asyncio.to_thread(resumes, slot_port, "regenerated")
        elsewhere = await connection_on(served, new[0], taken.token)
        await elsewhere.send(json.dumps(taken.resume()))
        assert await take(elsewhere, taken) == "done"
        await elsewhere.close()
        assert await asyncio.to_thread(resumes, slot_port, "regenerated") == before + 1
    assert taken.frames == expected.frames and taken.payload == expected.payload


async def test_a_stream_of_a_draining_child_is_resumed_through_the_other_byte_equal() -> None:
    # Slow enough that the owner still generates the stream while it drains (30 s at most).
    async with host(*NO_CACHE, "--fake-step-ms", "400") as served:
        expected = await unbroken(served.port, START)
        ws = await open_ws(served.port)
        owner = holder(served, ws)
        ((other, port),) = {pid: port for pid, port in children(served).items() if pid != owner}.items()
        taken = Taken(START)
        await ws.send(json.dumps({"type": "start", **START}))
        assert await take(ws, taken, pause_after=3) == "paused"
        before = await asyncio.to_thread(resumes, port, "forwarded")
        os.kill(owner, signal.SIGTERM)  # its own drain: the stream keeps running there
        async with asyncio.timeout(DEADLINE_S):
            while await _status(sibling_port(owner) or 0) == 200:
                await asyncio.sleep(0.05)  # draining: /ready is 503
        ws.transport.abort()
        elsewhere = await connection_on(served, other, taken.token)
        await elsewhere.send(json.dumps(taken.resume()))
        assert await take(elsewhere, taken) == "done"
        await elsewhere.close()
        # Forwarded to the draining owner (not regenerated): it finished the stream there.
        assert await asyncio.to_thread(resumes, port, "forwarded") == before + 1
        async with asyncio.timeout(DEADLINE_S):
            while owner in served.front_ends():
                await asyncio.sleep(0.05)  # its drain ended with the stream
    assert taken.frames == expected.frames and taken.payload == expected.payload


async def test_sixty_streams_cut_one_to_three_times_on_two_children_equal_uncut_streams(
    tmp_path: Path,
) -> None:
    """The cluster's cut-and-resume matrix against one host: a supervisor with 2 children."""
    count = 60
    async with host(*FLAGS, "--fake-step-ms", "5") as served:
        ports = children(served)
        # The matrix's helpers take a Cluster: its port, and a "replica" per child (its token's owner).
        cluster = Cluster((), tmp_path, size=2, port=served.port)
        cluster.replicas = [Replica(port, Path(os.devnull)) for port in sorted(ports.values())]
        expected = await references(cluster, count)
        rng = random.Random(24)
        plan = {n: cut_points(rng, len(expected[n].frames)) for n in range(count)}
        firsts: dict[int, int | None] = {}
        cuts: Counter[int] = Counter()
        resumed: Counter[int] = Counter()

        def cutter(n: int) -> Hook:
            points = list(plan[n])

            async def on_chunk(taken: int, stream: cs.SpeechStream, proxy: CuttableProxy) -> None:
                if points and taken >= points[0] and proxy.connected:
                    points.pop(0)
                    proxy.cut()

            return on_chunk

        limit = asyncio.Semaphore(20)

        async def bounded(n: int) -> bytes:
            async with limit:
                size = sum(len(f) + 7 for f in expected[n].frames.values())
                return await play(cluster, n, cutter(n), firsts, cuts, resumed, size)

        got = await asyncio.gather(*(bounded(n) for n in range(count)))
        forwarded = await asyncio.to_thread(resumes, served.port, "forwarded")
        local = await asyncio.to_thread(resumes, served.port, "local")
    assert [n for n in range(count) if got[n] != expected[n].payload] == []
    assert {n for n in range(count) if not 1 <= cuts[n] <= len(plan[n]) or resumed[n] < 1} == set()
    spread = Counter(firsts.values())
    assert set(spread) == {0, 1}, spread  # the kernel put streams on both children
    # About half the reconnects land on the other child: forwarded to the owner (which counts
    # the forwarded resume as local too).
    assert forwarded >= sum(resumed.values()) // 4 and local >= forwarded, (local, forwarded)


async def test_the_key_the_supervisor_made_is_in_a_private_file_and_on_no_command_line() -> None:
    async with host() as served:
        words = _cmdline(min(served.front_ends())).split()
        path = Path(words[words.index("--resume-secret-file") + 1])
        modes = await asyncio.to_thread(lambda: (path.stat().st_mode, path.parent.stat().st_mode))
        assert modes[0] & 0o777 == 0o600 and modes[1] & 0o777 == 0o700
        key = await asyncio.to_thread(path.read_text)
        processes = [served.proc.pid, *children_of(served.proc.pid)]
        assert len(key) >= 16 and not any(key in _cmdline(pid) for pid in processes)


async def test_advertise_url_with_several_front_end_processes_fails_the_start_with_one_line() -> None:
    proc = await spawn_server(
        *("--engine", "fake", "--port", str(free_port()), "--frontend-processes", "2"),
        *("--resume-secret", "x" * 16, "--advertise-url", "ws://10.1.2.3:8080"),
        env={**os.environ},
        stderr=asyncio.subprocess.PIPE,
    )
    err = await finished(proc)
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err
    assert "--advertise-url: not with --frontend-processes" in err
