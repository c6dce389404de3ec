"""Ended streams kept for a resume: capped oldest first, charged to the budget, no encoder (issue #42)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from server.audio import make_encoder
from server.audio.footprint import encoder_state_bytes
from server.core.events import Audio, Ended
from server.core.generation import Generation
from server.metrics import Metrics
from server.streams.budget import STREAM_OVERHEAD_BYTES, MemoryBudget
from server.streams.lifecycle import Lease, StreamState
from server.streams.outbox import Outbox
from server.streams.registry import StreamRegistry
from server.streams.stream import Stream


class NoControl:
    """A generation's client that ignores what the stream asks (the test feeds its events)."""

    def append(self, stream_id: int, text: str) -> None: ...
    def end_input(self, stream_id: int) -> None: ...
    def abort(self, stream_id: int) -> None: ...


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    executor = ThreadPoolExecutor(1)
    yield executor
    executor.shutdown()


class World:
    """A registry with caps, a budget, and streams made as the service makes them."""

    def __init__(self, pool: ThreadPoolExecutor, max_ended: int, per_client: int) -> None:
        self.pool = pool
        self.metrics = Metrics()
        self.registry = StreamRegistry(
            ttl_s=30, clock=lambda: 0.0, max_ended=max_ended, max_ended_per_client=per_client
        )
        self.budget = MemoryBudget(0, lambda: None)

    def stream(
        self, token: str, client: str = "c", fmt: str = "mp3", frame_ms: int = 20
    ) -> tuple[Stream, Lease, Generation]:
        lease = Lease(abort=lambda reason: None)
        charge = self.budget.charger(client)
        outbox = Outbox(
            sample_rate=48_000, max_unsent_s=10, replay_max_s=10, replay_max_bytes=1 << 20, charge=charge
        )
        generation = Generation(NoControl(), 0, on_queued=charge)
        stream = Stream(
            name=token,
            token=token,
            encoder=make_encoder(fmt, 48_000, frame_ms=frame_ms),
            outbox=outbox,
            lease=lease,
            metrics=self.metrics,
            pool=self.pool,
            generation=generation,
            ttl_s=30,
            on_freed=self.registry.remove,
            on_linger=self.registry.linger,
            client=client,
        )
        self.registry.add(stream)
        return stream, lease, generation


async def end(stream: Stream, generation: Generation) -> None:
    """Run the stream's events through a little audio to its end (as the engine client would)."""
    generation._push(Audio(0, np.zeros(4800, dtype=np.float32)))
    generation._push(Ended(0, "cancelled"))
    await asyncio.wait_for(stream.run(), 10)


async def delivered(stream: Stream, lease: Lease, generation: Generation) -> None:
    await end(stream, generation)
    async for _ in stream.deliver(lease, 0):
        pass
    assert stream.state is not StreamState.ATTACHED


def tokens(streams: list[Stream]) -> list[str]:
    return [s.token for s in streams]


async def test_a_stream_is_charged_for_its_encoder_until_its_end_then_for_itself_until_freed(
    pool: ThreadPoolExecutor,
) -> None:
    world = World(pool, 10, 10)
    stream, lease, generation = world.stream("a", fmt="mp3")
    assert stream.has_encoder
    assert world.budget.of("c") == STREAM_OVERHEAD_BYTES + encoder_state_bytes("mp3", 48_000)
    await delivered(stream, lease, generation)
    assert not stream.has_encoder
    assert world.budget.of("c") == STREAM_OVERHEAD_BYTES + stream.outbox.charged_bytes
    assert stream.buffered_bytes == world.budget.of("c")
    stream.close()
    assert world.budget.total == 0 and world.registry.ended() == []


async def test_the_per_client_cap_frees_the_oldest_ended_and_a_resume_takes_one_out_of_line(
    pool: ThreadPoolExecutor,
) -> None:
    world = World(pool, 100, 2)
    made = [world.stream(t) for t in ("a", "b", "c")]
    other = world.stream("x", client="other")
    for stream, lease, generation in [made[1], made[0], other]:  # b ends before a
        await delivered(stream, lease, generation)
    assert tokens(world.registry.ended("c")) == ["b", "a"]
    # A resume moves "b" to a new sender: no longer kept; it is the newest once delivered again.
    b, _, _ = made[1]
    again = Lease(abort=lambda reason: None)
    b.attach(again)
    assert tokens(world.registry.ended("c")) == ["a"]
    async for _ in b.deliver(again, 0):
        pass
    assert tokens(world.registry.ended("c")) == ["a", "b"]
    await delivered(*made[2])
    assert tokens(world.registry.ended("c")) == ["b", "c"] and made[0][0].state is StreamState.CLOSED
    assert world.registry.get("a") is None and tokens(world.registry.ended()) == ["x", "b", "c"]


async def test_a_stream_that_ends_while_detached_is_kept_and_expires_when_evicted(
    pool: ThreadPoolExecutor,
) -> None:
    world = World(pool, 1, 10)
    first, lease, generation = world.stream("a")
    first.detach(lease)
    assert world.registry.ended() == []  # still generating: not ended
    await end(first, generation)
    assert tokens(world.registry.ended()) == ["a"] and not first.has_encoder
    await delivered(*world.stream("b"))
    assert first.state is StreamState.EXPIRED and tokens(world.registry.ended()) == ["b"]


async def test_cap_zero_keeps_no_ended_stream(pool: ThreadPoolExecutor) -> None:
    world = World(pool, 0, 0)
    stream, lease, generation = world.stream("a")
    await delivered(stream, lease, generation)
    assert stream.state is StreamState.CLOSED and len(world.registry) == 0 and world.budget.total == 0


async def test_the_memory_budget_frees_the_oldest_ended_stream_first(pool: ThreadPoolExecutor) -> None:
    world = World(pool, 100, 100)
    running, _, _ = world.stream("running", client="big")
    made_first, made_later = world.stream("made-first"), world.stream("made-later")
    await delivered(*made_later)
    await delivered(*made_first)
    assert world.registry.budget_victim(world.budget) is made_later[0]  # it ended first
    made_later[0].close()
    assert world.registry.budget_victim(world.budget) is made_first[0]
    made_first[0].close()
    assert world.registry.budget_victim(world.budget) is running


def test_every_format_and_rate_has_a_measured_encoder_size() -> None:
    # A new format or rate must be measured (python -m bench.studies.encoder_state), not charged a guess.
    from server.audio import SUPPORTED_FORMATS, SUPPORTED_RATES
    from server.audio.footprint import ENCODER_STATE_BYTES

    assert {(f, r) for f in SUPPORTED_FORMATS for r in SUPPORTED_RATES} == {
        (f, r) for f, by_rate in ENCODER_STATE_BYTES.items() for r in by_rate
    }


@pytest.mark.parametrize("fmt", ["pcm16", "opus"])
async def test_longer_frames_charge_the_longest_partial_frame_the_encoder_may_hold(
    pool: ThreadPoolExecutor, fmt: str
) -> None:
    world = World(pool, 10, 10)
    world.stream("a", fmt=fmt)
    world.stream("b", client="d", fmt=fmt, frame_ms=60)
    measured = encoder_state_bytes(fmt, 48_000)
    assert world.budget.of("c") == STREAM_OVERHEAD_BYTES + measured
    # 40 ms more of float32 samples at 48 kHz: what a 60 ms frame not yet whole may hold.
    assert world.budget.of("d") == STREAM_OVERHEAD_BYTES + measured + 1920 * 4
    encoder = make_encoder(fmt, 48_000, frame_ms=60)
    encoder.push(np.zeros(1439, dtype=np.float32))  # 24 kHz in: just short of one 60 ms frame out
    held = encoder.inner._pending if fmt == "pcm16" else encoder.inner.stream._pending  # type: ignore[attr-defined]
    assert held.nbytes - 960 * 4 <= 1920 * 4  # beyond a 20 ms frame's, within the charge
