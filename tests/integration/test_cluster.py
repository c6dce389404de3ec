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


async def replica_metric(cluster: Cluster, name: str, labels: str = "") -> float:
    """A metric summed over the replicas still running."""
    running = [r for r in cluster.replicas if r.proc is not None and r.proc.returncode is None]
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
