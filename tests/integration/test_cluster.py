"""Three replicas behind HAProxy (round-robin, no affinity): cuts, a SIGKILL, a SIGTERM drain.

The replicas are ``python -m server serve`` processes with the fake engine and a shared resume
secret; the clients are ``client_py``'s, one per stream, each behind its own cuttable proxy
(the network between the client and the balancer). Every stream's audio must equal an uncut
stream of the same request byte for byte. Skipped only where HAProxy is not installed
(``scripts/setup.sh --dev`` installs it, so CI runs it).
"""

from __future__ import annotations

import asyncio
import random
import signal
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

import chattts_stream_client as cs
from server.streams.routing import Router, parse_networks
from tests.cluster import HAPROXY, Cluster
from tests.resumer import Taken, unbroken
from tests.tcp_proxy import CuttableProxy

pytestmark = [
    pytest.mark.skipif(
        HAPROXY is None, reason="HAProxy is not installed (scripts/setup.sh --dev installs it)"
    ),
    pytest.mark.timeout(300),
]

SECRET = "cluster-test-secret-0123456789abcdef"
SENTENCES = [
    "The first sentence is here.",
    "第二句话在这里。",
    "And then a third one, a little longer than the others.",
    "Short fourth.",
    "五，最后一句。",
]
FLAGS = ("--resume-secret", SECRET, "--cache-bytes", "0", "--resume-ttl-s", "30", "--log-level", "warning")
#: Each client's link to the balancer delivers its stream in about this long (so that a cut
#: finds the rest of the stream in flight, as on a real network, not in the client's buffer).
DELIVERY_S = 0.8
ROUTER = Router(SECRET.encode(), "ws://0.0.0.0:1", parse_networks("0.0.0.0/0"))


def request(n: int) -> dict[str, object]:
    """Stream ``n``'s request: its own text, seed and format (pcm16 and opus alternate)."""
    rng = random.Random(n)
    text = " ".join(rng.sample(SENTENCES, k=3))
    return {"text": text, "seed": 1000 + n, "format": "pcm16" if n % 2 == 0 else "opus"}


def owner(cluster: Cluster, token: str | None) -> int | None:
    claims = ROUTER.verify(token or "")
    return None if claims is None else cluster.owner(claims.owner)


async def references(cluster: Cluster, count: int) -> list[Taken]:
    """The uncut stream of every request (through the balancer, so on every replica)."""
    return list(
        await asyncio.gather(*(unbroken(cluster.port, {"id": f"ref{n}", **request(n)}) for n in range(count)))
    )


Hook = Callable[[int, cs.SpeechStream, CuttableProxy], Awaitable[None]]


async def play(
    cluster: Cluster,
    n: int,
    on_chunk: Hook,
    firsts: dict[int, int | None],
    cuts: Counter[int],
    resumes: Counter[int],
    size: int,
) -> bytes:
    """Stream ``n`` through its own proxy to the balancer; ``on_chunk`` after each chunk."""
    async with CuttableProxy(cluster.port, downstream_bytes_per_s=size / DELIVERY_S) as proxy:
        client = cs.Client(f"ws://127.0.0.1:{proxy.port}/v1/stream", read_timeout=60, max_queued_chunks=2)
        fields = request(n)
        audio: list[bytes] = []
        async with client:
            stream = client.speak(str(fields["text"]), seed=int(fields["seed"]), format=str(fields["format"]))  # type: ignore[call-overload]
            async for chunk in stream:
                if not audio:
                    firsts[n] = owner(cluster, stream.token)
                audio.append(chunk.data)
                await on_chunk(len(audio), stream, proxy)
        assert stream.done is not None and stream.done.reason == "complete", stream.error
        cuts[n] = proxy.cuts
        resumes[n] = stream.resumes
        return b"".join(audio)


def cut_points(rng: random.Random, frames: int) -> list[int]:
    """1-3 chunk counts to cut after: the first in the stream's first half, the rest 8+ chunks apart."""
    first = rng.randrange(3, frames // 2)
    later = range(first + 8, frames - 10, 8)
    return [first, *sorted(rng.sample(later, k=min(len(later), rng.randint(0, 2))))]


async def replica_metric(cluster: Cluster, name: str, labels: str = "", *, but: int | None = None) -> float:
    """A metric summed over the replicas still running (but replica ``but``)."""
    running = [
        r
        for n, r in enumerate(cluster.replicas)
        if r.proc is not None and r.proc.returncode is None and n != but
    ]
    return sum(await asyncio.gather(*(asyncio.to_thread(r.metric, name, labels) for r in running)))


async def test_sixty_streams_cut_one_to_three_times_equal_uncut_streams(tmp_path: Path) -> None:
    """Acceptance 1: 60 streams (pcm16 and opus), 1-3 cuts each at seeded random points."""
    count = 60
    async with Cluster((*FLAGS, "--fake-step-ms", "5"), tmp_path) as cluster:
        expected = await references(cluster, count)
        rng = random.Random(24)
        plan = {n: cut_points(rng, len(expected[n].frames)) for n in range(count)}
        firsts: dict[int, int | None] = {}
        cuts: Counter[int] = Counter()
        resumes: Counter[int] = Counter()

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
                size = sum(len(f) + 7 for f in expected[n].frames.values())  # + the header and framing
                return await play(cluster, n, cutter(n), firsts, cuts, resumes, size)

        got = await asyncio.gather(*(bounded(n) for n in range(count)))
        forwarded = await replica_metric(cluster, "chattts_resumes_total", 'how="forwarded"')
        local = await replica_metric(cluster, "chattts_resumes_total", 'how="local"')
    assert [n for n in range(count) if got[n] != expected[n].payload] == []
    # Each stream was cut 1-3 times, and at least its first cut broke it (the client resumed).
    # A later cut may find the rest of the stream already in the client's socket buffer.
    assert {n for n in range(count) if not 1 <= cuts[n] <= len(plan[n]) or resumes[n] < 1} == set()
    spread = Counter(firsts.values())
    assert set(spread) == {0, 1, 2} and min(spread.values()) >= count // 6, spread  # round-robin, no affinity
    # Most reconnects reached another replica than the owner: forwarded there (the owner counts
    # the forwarded resume as local too).
    assert local == sum(resumes.values()) and forwarded >= local // 2, (local, forwarded)


async def test_thirty_streams_outlive_a_replica_killed_with_sigkill(tmp_path: Path) -> None:
    """Acceptance 2: SIGKILL one replica while 30 streams play (some on it, some relayed from it)."""
    count, victim = 30, 0
    # Generation at about twice real time, so that the kill finds most of each stream not yet
    # generated (what was generated may sit in socket buffers and still arrive).
    async with Cluster((*FLAGS, "--fake-step-ms", "150"), tmp_path) as cluster:
        expected = await references(cluster, count)
        rng = random.Random(2)
        pauses = {n: rng.randrange(8, 16) for n in range(count)}
        at_kill: dict[int, int | None] = {}
        proxies: list[CuttableProxy] = []
        all_paused, killed = asyncio.Event(), asyncio.Event()

        def pauser(n: int) -> Hook:
            async def on_chunk(taken: int, stream: cs.SpeechStream, proxy: CuttableProxy) -> None:
                if taken == pauses[n] - 4 and proxy.connected:
                    proxy.cut()  # resumed before the kill: two in three are relayed from their owner
                if taken == pauses[n]:
                    at_kill[n] = owner(cluster, stream.token)
                    proxy.stall()  # the rest of the stream waits upstream: nothing is in the client yet
                    proxies.append(proxy)
                    if len(at_kill) == count:
                        all_paused.set()

            return on_chunk

        async def stalled_then_killed() -> None:
            async with asyncio.timeout(60):
                await all_paused.wait()
            await cluster.kill(victim)
            killed.set()
            for proxy in proxies:
                proxy.flow()

        sizes = [sum(len(f) + 7 for f in e.frames.values()) for e in expected]
        firsts: dict[int, int | None] = {}
        cuts: Counter[int] = Counter()
        resumes: Counter[int] = Counter()
        plays = [play(cluster, n, pauser(n), firsts, cuts, resumes, sizes[n]) for n in range(count)]
        got, _ = await asyncio.gather(asyncio.gather(*plays), stalled_then_killed())
        regenerated = await replica_metric(cluster, "chattts_resumes_total", 'how="regenerated"')
    assert [n for n in range(count) if got[n] != expected[n].payload] == []
    on_victim = [n for n, at in at_kill.items() if at == victim]
    assert len(on_victim) >= 3, at_kill  # round-robin put some on it
    assert regenerated >= max(3, len(on_victim) // 2), (regenerated, on_victim)  # exact: compared above


async def test_a_replica_drained_with_sigterm_mid_stream_loses_nothing(tmp_path: Path) -> None:
    """Acceptance 2: SIGTERM one replica while 30 streams play. Of the streams it owns, a third
    play on (they finish there), a third lose their connection during the drain (the resume
    reaches another replica and is forwarded to the draining owner), a third wait until it has
    exited (its drain timeout cut them: they are regenerated elsewhere)."""
    count, drained = 30, 1
    flags = (*FLAGS, "--fake-step-ms", "150", "--drain-timeout-s", "2")
    async with Cluster(flags, tmp_path) as cluster:
        expected = await references(cluster, count)
        rng = random.Random(3)
        pauses = {n: rng.randrange(8, 16) for n in range(count)}
        at_drain: dict[int, int | None] = {}
        proxies: dict[int, CuttableProxy] = {}
        all_paused = asyncio.Event()

        def pauser(n: int) -> Hook:
            async def on_chunk(taken: int, stream: cs.SpeechStream, proxy: CuttableProxy) -> None:
                if taken == pauses[n]:
                    at_drain[n] = owner(cluster, stream.token)
                    proxy.stall()
                    proxies[n] = proxy
                    if len(at_drain) == count:
                        all_paused.set()

            return on_chunk

        async def drain_one() -> tuple[int | None, float]:
            async with asyncio.timeout(60):
                await all_paused.wait()
            proc = cluster.replicas[drained].proc
            assert proc is not None
            forwarded = 'how="forwarded"'
            before = await replica_metric(cluster, "chattts_resumes_total", forwarded, but=drained)
            proc.send_signal(signal.SIGTERM)
            its = sorted(n for n, at in at_drain.items() if at == drained)
            for rank, n in enumerate(its):
                if rank % 3 == 0:
                    proxies[n].flow()  # plays on to its end on the draining replica
                elif rank % 3 == 1:
                    proxies[n].flow()
                    proxies[n].cut()  # resumed elsewhere, forwarded to the draining owner
            for n, at in at_drain.items():
                if at != drained:
                    proxies[n].flow()
            async with asyncio.timeout(30):
                await proc.wait()
            during = await replica_metric(cluster, "chattts_resumes_total", forwarded, but=drained)
            for proxy in proxies.values():
                proxy.flow()  # the rest find their owner gone, and are regenerated elsewhere
            return proc.returncode, during - before

        sizes = [sum(len(f) + 7 for f in e.frames.values()) for e in expected]
        firsts: dict[int, int | None] = {}
        cuts: Counter[int] = Counter()
        resumes: Counter[int] = Counter()
        plays = [play(cluster, n, pauser(n), firsts, cuts, resumes, sizes[n]) for n in range(count)]
        got, (exit_code, forwarded_to_it) = await asyncio.gather(asyncio.gather(*plays), drain_one())
    assert [n for n in range(count) if got[n] != expected[n].payload] == []
    assert sum(1 for at in at_drain.values() if at == drained) >= 3, at_drain
    assert exit_code == 0 and forwarded_to_it >= 1, (exit_code, forwarded_to_it)
