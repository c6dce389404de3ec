"""A stream's lifecycle has one owner: its transitions, and the metrics they count, once."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from server.audio import make_encoder
from server.audio.base import EncodedFrame
from server.metrics import Metrics
from server.streams.items import Done, OutItem
from server.streams.lifecycle import Lease, StreamState
from server.streams.outbox import Outbox
from server.streams.registry import StreamRegistry
from server.streams.stream import Stream


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    executor = ThreadPoolExecutor(1)
    yield executor
    executor.shutdown()


def make_stream(
    metrics: Metrics, pool: ThreadPoolExecutor, clock: Clock, token: str = "t"
) -> tuple[Stream, Lease]:
    lease = Lease(abort=lambda reason: None)
    outbox = Outbox(sample_rate=24_000, max_unsent_s=10, replay_max_s=10, replay_max_bytes=1 << 20)
    stream = Stream(
        name="s",
        token=token,
        encoder=make_encoder("pcm16", 24_000),
        outbox=outbox,
        lease=lease,
        metrics=metrics,
        pool=pool,
        ttl_s=30,
        clock=clock,
    )
    return stream, lease


async def deliver(stream: Stream, lease: Lease) -> list[OutItem]:
    """Pull every item ``lease`` may send, as a front end does; the stream is delivered after."""
    sent: list[OutItem] = []
    async for items in stream.deliver(lease, stream.outbox.sent_index):
        sent.extend(items)
    return sent


def counted(metrics: Metrics) -> dict[str, float]:
    return {
        sample.labels["reason"]: sample.value
        for metric in metrics.streams_total.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    }


def active(metrics: Metrics) -> float:
    return metrics.active_streams._value.get()  # type: ignore[attr-defined, no-any-return]


async def test_delivered_once_then_lingers_until_the_ttl(pool: ThreadPoolExecutor) -> None:
    metrics, clock = Metrics(), Clock()
    stream, lease = make_stream(metrics, pool, clock)
    registry = StreamRegistry(ttl_s=30, clock=clock)
    registry.add(stream)
    assert stream.state is StreamState.ATTACHED and active(metrics) == 1 and registry.active() == 1
    stream.outbox.finish("complete", [EncodedFrame(b"", 0)])
    assert isinstance((await deliver(stream, lease))[-1], Done)
    assert stream.state is StreamState.DELIVERED and counted(metrics) == {"complete": 1.0}
    assert active(metrics) == 0 and registry.active() == 0 and not stream.busy
    # A late resume replays it; delivering again does not count it again.
    again = Lease(abort=lambda reason: None)
    stream.attach(again)
    await deliver(stream, again)
    assert stream.state is StreamState.DELIVERED
    assert counted(metrics) == {"complete": 1.0}
    clock.now += 29.9
    assert registry.expired() == []
    clock.now += 0.1
    assert registry.expired() == [stream]
    stream.close()
    assert stream.state is StreamState.CLOSED and counted(metrics) == {"complete": 1.0}


def test_detached_then_expired_counts_expired(pool: ThreadPoolExecutor) -> None:
    metrics, clock = Metrics(), Clock()
    stream, lease = make_stream(metrics, pool, clock)
    stream.detach(lease)
    assert stream.state is StreamState.DETACHED and stream.idle_since() == clock.now and stream.busy
    stream.expire()
    assert (
        stream.state is StreamState.EXPIRED and counted(metrics) == {"expired": 1.0} and active(metrics) == 0
    )
    with pytest.raises(RuntimeError):
        stream.attach(Lease(abort=lambda reason: None))  # a freed stream cannot come back


async def test_moving_revokes_the_old_lease_and_its_late_calls_change_nothing(
    pool: ThreadPoolExecutor,
) -> None:
    metrics, clock = Metrics(), Clock()
    stream, old = make_stream(metrics, pool, clock)
    stream.outbox.on_frames([EncodedFrame(b"\0" * 960, 480)], 480)
    new = Lease(abort=lambda reason: None)
    stream.attach(new)
    assert old.revoked and stream.lease is new
    stream.sent(old, 1, frames=1)  # the old pump finishing a send: ignored
    stream.detach(old)  # the old connection closing: ignored
    assert await deliver(stream, old) == []  # the old pump pulling again: nothing, and no delivery
    assert stream.state is StreamState.ATTACHED and stream.outbox.sent_index == 0 and counted(metrics) == {}
    stream.sent(new, 1, frames=1)
    assert stream.outbox.sent_index == 1 and stream.first_frame_at == clock.now


def test_closing_an_undelivered_stream_counts_the_reason_given(pool: ThreadPoolExecutor) -> None:
    metrics, clock = Metrics(), Clock()
    stream, lease = make_stream(metrics, pool, clock)
    stream.close("cancelled")
    assert lease.revoked and stream.lease is None and counted(metrics) == {"cancelled": 1.0}


async def test_the_replay_budget_drops_delivered_streams_oldest_first(pool: ThreadPoolExecutor) -> None:
    metrics, clock = Metrics(), Clock()
    registry = StreamRegistry(ttl_s=30, clock=clock)
    streams = []
    for token in ("a", "b", "c"):
        stream, lease = make_stream(metrics, pool, clock, token)
        stream.outbox.on_frames([EncodedFrame(b"\0" * 1000, 480)], 480)
        stream.outbox.finish("complete", [])
        if token != "b":
            await deliver(stream, lease)  # b is still being sent: never dropped for the budget
        registry.add(stream)
        streams.append(stream)
    assert registry.over_budget(2500) == [streams[0]]
    assert registry.over_budget(500) == [streams[0], streams[2]]
