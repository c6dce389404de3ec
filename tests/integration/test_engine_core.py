"""The real inference thread over the fake engine, through the engine client.

The policy's rules are tested without threads in tests/unit/test_policy.py;
these check that the core carries them out on a live engine: batching,
look-ahead, failures, admission, cancellation. Assertions come from the
engine's step and event logs, not from wall time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import numpy as np
import pytest

from server.core.client import EngineClient
from server.core.events import Audio, Ended, SegmentStarted, StreamEvent
from server.core.generation import GenerateRequest, Generation
from server.core.policy import PolicyConfig
from server.engine.fake import FAIL_MARKER, FakeEngine, expected_audio
from server.engine_api import EngineError, StepResult, SynthesisParams
from server.errors import EngineUnavailable, Overloaded
from server.metrics import Metrics


@dataclass
class Sink:
    """Every event of one generation, collected by a task."""

    events: list[StreamEvent] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    @property
    def end(self) -> Ended:
        last = self.events[-1]
        assert isinstance(last, Ended)
        return last


class Sched:
    """The test's handle: submit streams, collect their events."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    def submit(self, segments: list[str], params: SynthesisParams, sink: Sink) -> Generation:
        generation = self.client.generate(GenerateRequest(segments=tuple(segments), params=params))

        async def collect() -> None:
            async for event in generation:
                sink.events.append(event)

        sink.task = asyncio.create_task(collect())
        return generation

    @property
    def breaker_open(self) -> bool:
        return self.client.breaker_open


@asynccontextmanager
async def run_core(
    engine: FakeEngine, metrics: Metrics | None = None, **config: object
) -> AsyncIterator[Sched]:
    metrics = metrics or Metrics()
    client = EngineClient(lambda: engine, config=PolicyConfig(**config), metrics=metrics)  # type: ignore[arg-type]
    await client.start()
    async with asyncio.timeout(30):
        await client.wait_ready()
    try:
        yield Sched(client)
    finally:
        await client.stop()


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(step_base_s=0.002, step_per_row_s=0.0002)


async def wait_all(sinks: list[Sink]) -> None:
    async with asyncio.timeout(60):
        await asyncio.gather(*(s.task for s in sinks if s.task is not None))


async def wait_steps(engine: FakeEngine, count: int) -> None:
    async with asyncio.timeout(10):
        while len(engine.steps) < count:
            await asyncio.sleep(0.001)


def steps_with(engine: FakeEngine, seq_id: int) -> list[int]:
    return [rec.index for rec in engine.steps if seq_id in rec.seq_ids]


async def test_sixteen_streams_run_in_one_batch_and_a_newcomer_waits_one_block(engine: FakeEngine) -> None:
    async with run_core(engine, max_batch=32, max_wait_s=0.05) as sched:
        sinks = [Sink() for _ in range(16)]
        long_text = "a long running text " * 8
        for i, sink in enumerate(sinks):
            sched.submit([long_text], SynthesisParams(seed=i), sink)
        # Wait until the batch is running, then add a newcomer mid-batch.
        await wait_steps(engine, 3)
        newcomer = Sink()
        steps_started_at_submit = engine.steps[-1].index + 2  # the running step + 1
        sched.submit(["newcomer arrives."], SynthesisParams(seed=99), newcomer)
        await wait_all([*sinks, newcomer])

        assert engine.steps[0].seq_ids == tuple(range(16))  # all sixteen in the first step
        assert max(len(rec.seq_ids) for rec in engine.steps) == 17
        first_newcomer_step = min(steps_with(engine, 16))
        assert first_newcomer_step <= steps_started_at_submit
        # The others were still running when the newcomer joined: it did not wait for the batch.
        assert max(steps_with(engine, 0)) > first_newcomer_step
        assert all(s.end.reason == "complete" for s in [*sinks, newcomer])


async def test_batch_is_capped_and_waiting_sequences_join_at_block_boundaries(engine: FakeEngine) -> None:
    async with run_core(engine, max_batch=4, max_wait_s=0.0) as sched:
        sinks = [Sink() for _ in range(10)]
        for i, sink in enumerate(sinks):
            sched.submit([f"stream {i} text here"], SynthesisParams(seed=i), sink)
        await wait_all(sinks)
        assert max(len(rec.seq_ids) for rec in engine.steps) == 4
        assert all(s.end.reason == "complete" for s in sinks)


async def test_next_segment_generates_before_the_current_one_finishes(engine: FakeEngine) -> None:
    async with run_core(engine, lookahead=1, lookahead_lead_s=0.0) as sched:  # 0: look-ahead ungated
        sink = Sink()
        # Each segment longer than the one before, so k+1 is still running when k ends.
        segments = [
            "First sentence.",
            "The second sentence is longer.",
            "The third sentence is the longest one.",
        ]
        sched.submit(segments, SynthesisParams(seed=1), sink)
        await wait_all([sink])
        events = list(engine.events)
        for k in range(2):
            assert events.index(("add", k + 1)) < events.index(("finish", k))
            # ... and it really stepped before segment k finished.
            finish_k = max(steps_with(engine, k))
            assert min(steps_with(engine, k + 1)) <= finish_k
        # Audio still arrives strictly in segment order.
        starts = [e.index for e in sink.events if isinstance(e, SegmentStarted)]
        assert starts == [0, 1, 2]


async def test_a_look_ahead_waits_while_its_stream_is_not_far_enough_ahead(engine: FakeEngine) -> None:
    """No stream gets 1000 s ahead: each look-ahead segment is added, but steps only once heard."""
    async with run_core(engine, lookahead=1, lookahead_lead_s=1000.0) as sched:
        sink = Sink()
        segments = ["First sentence.", "The second sentence is longer.", "Third."]
        sched.submit(segments, SynthesisParams(seed=1), sink)
        await wait_all([sink])
        events = list(engine.events)
        for k in range(2):
            assert events.index(("add", k + 1)) < events.index(("finish", k))  # queued as before
            assert min(steps_with(engine, k + 1)) > max(steps_with(engine, k))  # but not stepped
        assert [e.index for e in sink.events if isinstance(e, SegmentStarted)] == [0, 1, 2]
        assert sink.end is not None and sink.end.reason == "complete"


async def test_a_segment_that_finishes_early_does_not_stall_the_next(engine: FakeEngine) -> None:
    async with run_core(engine, lookahead=1) as sched:
        sink = Sink()
        # Segment 1 is short: it starts with segment 0 and ends first; segment 2 must then
        # start before segment 0 ends (held audio does not count against look-ahead).
        segments = ["A rather long first sentence with many words in it.", "Short.", "Third."]
        sched.submit(segments, SynthesisParams(seed=1), sink)
        await wait_all([sink])
        events = list(engine.events)
        assert events.index(("finish", 1)) < events.index(("finish", 0))
        assert events.index(("add", 2)) < events.index(("finish", 0))
        starts = [e.index for e in sink.events if isinstance(e, SegmentStarted)]
        assert starts == [0, 1, 2]


async def test_one_stream_cannot_take_more_than_its_share(engine: FakeEngine) -> None:
    async with run_core(engine, max_batch=2, lookahead=3, max_wait_s=0.05) as sched:
        greedy, other = Sink(), Sink()
        sched.submit(
            [f"segment {k} of the greedy stream." for k in range(6)], SynthesisParams(seed=1), greedy
        )
        sched.submit(["the other stream."], SynthesisParams(seed=2), other)
        await wait_all([greedy, other])
        # The other stream's first segment got a slot in the very first step, ahead of look-ahead work.
        other_seq = next(seq for kind, seq in engine.events if kind == "add" and seq not in range(0, 1))
        assert min(steps_with(engine, other_seq)) == 0


async def test_engine_exception_fails_only_that_step(engine: FakeEngine) -> None:
    async with run_core(engine, max_batch=8, max_wait_s=0.0) as sched:
        poisoned = Sink()
        sched.submit([f"this one breaks {FAIL_MARKER}"], SynthesisParams(seed=1), poisoned)
        await wait_all([poisoned])
        assert poisoned.end.reason == "error" and "failed" in poisoned.end.message
        later = [Sink() for _ in range(3)]
        for i, sink in enumerate(later):
            sched.submit(["the loop keeps serving."], SynthesisParams(seed=i), sink)
        await wait_all(later)
        assert all(s.end.reason == "complete" for s in later)
        assert engine.live_sequences == 0


async def test_out_of_memory_halves_the_batch_and_requests_complete(engine: FakeEngine) -> None:
    engine.failures.oom_above_batch = 4
    async with run_core(engine, max_batch=16, max_wait_s=0.05) as sched:
        sinks = [Sink() for _ in range(10)]
        for i, sink in enumerate(sinks):
            sched.submit(["out of memory at large batches."], SynthesisParams(seed=i), sink)
        await wait_all(sinks)
        assert all(s.end.reason == "complete" for s in sinks)
        failed = [rec for rec in engine.steps if rec.failed]
        assert failed and len(failed[0].seq_ids) == 10
        ok_sizes = [len(rec.seq_ids) for rec in engine.steps if not rec.failed]
        assert max(ok_sizes) <= 4


async def test_breaker_opens_after_repeated_failures_and_a_probe_closes_it(engine: FakeEngine) -> None:
    async with run_core(engine, breaker_threshold=3, breaker_probe_interval_s=0.05, max_wait_s=0.0) as sched:
        engine.failures.fail_steps = 4  # three steps fail, then the first probe fails too
        sinks = [Sink() for _ in range(3)]
        for i, sink in enumerate(sinks):
            sched.submit(["fails."], SynthesisParams(seed=i), sink)
            await wait_all([sink])
        assert all(s.end.reason == "error" for s in sinks)
        assert sched.breaker_open
        async with asyncio.timeout(20):
            while sched.breaker_open:
                await asyncio.sleep(0.01)
        ok = Sink()
        sched.submit(["works again."], SynthesisParams(seed=5), ok)
        await wait_all([ok])
        assert ok.end.reason == "complete"


async def test_full_queue_answers_overloaded_with_retry_after() -> None:
    slow = FakeEngine(step_base_s=0.05, step_per_row_s=0.0)
    async with run_core(slow, max_batch=1, max_queue=2, max_wait_s=0.0) as sched:
        accepted: list[Sink] = []
        with pytest.raises(Overloaded) as refused:
            for i in range(10):
                sink = Sink()
                sched.submit(["queued text."], SynthesisParams(seed=i), sink)
                accepted.append(sink)
        assert refused.value.retry_after_ms is not None
        assert refused.value.retry_after_ms >= 250
        assert 2 <= len(accepted) <= 3
        await wait_all(accepted)
        assert all(s.end.reason == "complete" for s in accepted)
        sink = Sink()
        sched.submit(["healthy afterwards."], SynthesisParams(seed=1), sink)
        await wait_all([sink])


async def test_cancel_frees_the_row_at_the_next_block_boundary() -> None:
    engine = FakeEngine(step_base_s=0.01, step_per_row_s=0.0)
    async with run_core(engine, max_wait_s=0.0) as sched:
        keep, gone = Sink(), Sink()
        sched.submit(["a long text that keeps running " * 6], SynthesisParams(seed=1), keep)
        handle = sched.submit(["another long text to cancel " * 6], SynthesisParams(seed=2), gone)
        await wait_steps(engine, 3)
        running_step = engine.steps[-1].index + 1  # may be in flight now
        handle.abort()
        await wait_all([gone])
        assert gone.end.reason == "cancelled"  # at once: the generation does not wait for the core
        async with asyncio.timeout(10):
            while ("drop", 1) not in engine.events:  # freed by the core's next batch
                await asyncio.sleep(0.001)
        later_steps = [i for i in steps_with(engine, 1) if i > running_step]
        assert later_steps == []
        await wait_all([keep])
        assert keep.end.reason == "complete"


async def test_failed_engine_warm_up_opens_the_breaker_instead_of_killing_the_loop() -> None:
    engine = FakeEngine()
    engine.failures.fail_steps = 2  # the start-up warm-up and the first probe fail
    async with run_core(engine, breaker_probe_interval_s=0.05) as sched:
        assert sched.breaker_open and sched.client.alive
        with pytest.raises(Overloaded):
            sched.submit(["refused while broken."], SynthesisParams(seed=1), Sink())
        async with asyncio.timeout(20):
            while sched.breaker_open:
                await asyncio.sleep(0.01)
        sink = Sink()
        sched.submit(["served after recovery."], SynthesisParams(seed=1), sink)
        await wait_all([sink])
        assert sink.end.reason == "complete"


async def test_a_stopped_loop_refuses_new_streams(engine: FakeEngine) -> None:
    async with run_core(engine) as sched:
        await sched.client.stop()
        with pytest.raises(EngineUnavailable):
            sched.submit(["too late."], SynthesisParams(seed=1), Sink())


class Interruptible(FakeEngine):
    """A fake whose step lasts 5 s (while ``slow``: not during warm-up) unless ``interrupt`` ends it."""

    def __init__(self) -> None:
        super().__init__(step_base_s=0.0, step_per_row_s=0.0)
        self.interrupt: Callable[[], bool] | None = None
        self.slow = False
        self.cut_short = 0
        #: Set once a slow step is under way (the test sends its command only then).
        self.in_slow_step = threading.Event()

    def step(self, seq_ids: list[int]) -> list[StepResult]:
        deadline = time.monotonic() + 5.0
        if self.slow:
            self.in_slow_step.set()
        while self.slow and time.monotonic() < deadline:
            if self.interrupt is not None and self.interrupt():
                self.cut_short += 1
                break
            time.sleep(0.001)
        return super().step(seq_ids)


async def test_a_waiting_command_ends_the_running_block_so_a_newcomer_joins_at_once() -> None:
    engine = Interruptible()
    async with run_core(engine, max_wait_s=0.0) as sched:
        assert engine.interrupt is not None  # the core set it once the engine was ready
        engine.slow = True
        first, newcomer = Sink(), Sink()
        sched.submit(["A long first stream, with many blocks to go."], SynthesisParams(seed=1), first)
        # Send the newcomer only once a slow step is in flight (5 s, unless cut short). Waiting for
        # a step to be *recorded* raced on a loaded machine: the command could reach the core
        # between two steps, join without a cut, and leave ``cut_short`` at 0.
        async with asyncio.timeout(10):
            while not engine.in_slow_step.is_set():
                await asyncio.sleep(0.001)
        sched.submit(["newcomer."], SynthesisParams(seed=2), newcomer)
        async with asyncio.timeout(4.0):  # inside the 5 s one uninterrupted step lasts
            while ("add", 1) not in list(engine.events):  # the newcomer (seq 1) joined the batch
                await asyncio.sleep(0.005)
        assert engine.cut_short >= 1
        assert not engine.interrupt()  # taking the command in cleared the signal
        engine.slow = False
        await wait_all([first, newcomer])
        assert first.end.reason == newcomer.end.reason == "complete"


async def test_block_tokens_histogram_counts_each_steps_token_steps(engine: FakeEngine) -> None:
    """``chattts_block_tokens``: one observation per engine step, the longest row's tokens."""
    from server.engine.fake import token_count

    metrics = Metrics()
    async with run_core(engine, metrics) as sched:

        def sample(name: str, labels: dict[str, str] | None = None) -> float:
            return metrics.registry.get_sample_value(name, labels) or 0.0

        short_before = sample("chattts_block_tokens_bucket", {"le": "4.0"})
        steps_before = sample("chattts_block_tokens_count")
        tokens_before = sample("chattts_block_tokens_sum")
        text = "one stream alone, several blocks long"
        sink = Sink()
        sched.submit([text], SynthesisParams(seed=3), sink)
        await wait_all([sink])
        assert sink.end.reason == "complete"
        # Alone in every step, the stream's tokens are each step's longest row.
        assert sample("chattts_block_tokens_sum") - tokens_before == token_count(text, 2.0, 1 << 20)
        steps = sample("chattts_block_tokens_count") - steps_before
        rest = token_count(text, 2.0, 1 << 20) - engine.first_block_tokens
        assert steps == 1 + -(-rest // engine.block_tokens)
        # The first block is the engine's short one (4 tokens): one observation in the "≤ 4" bucket
        # (the last block, the remainder, is longer than 4 here).
        assert rest % engine.block_tokens > 4
        assert sample("chattts_block_tokens_bucket", {"le": "4.0"}) - short_before == 1


class Stepwise(FakeEngine):
    """A fake whose steps (once ``gated``: not during warm-up) each wait for the test's permit.

    The test decides how many steps run, so what the core does between two of them is
    asserted without racing the inference thread. A step that gets no permit in 10 s fails.
    """

    def __init__(self) -> None:
        # A long first block: 400 tokens are 8.5 s of audio, so a stream is far ahead of real
        # time after one step, and stays ahead however slow this machine is.
        super().__init__(step_base_s=0.0, step_per_row_s=0.0, first_block_tokens=400)
        self.gated = False
        self.permits = threading.Semaphore(0)

    def step(self, seq_ids: list[int]) -> list[StepResult]:
        if self.gated and not self.permits.acquire(timeout=10):
            raise EngineError("the test gave no permit")
        return super().step(seq_ids)

    async def run_steps(self, count: int) -> None:
        """Let ``count`` more steps run and wait until they are logged."""
        target = len(self.steps) + count
        self.permits.release(count)
        async with asyncio.timeout(10):
            while len(self.steps) < target:
                await asyncio.sleep(0.001)


async def test_a_look_ahead_row_ahead_of_real_time_gives_its_place_to_a_newcomer() -> None:
    engine = Stepwise()
    async with run_core(engine, max_batch=2, lookahead=1, lookahead_lead_s=1.0, max_wait_s=0.0) as sched:
        engine.gated = True
        params = SynthesisParams(seed=5)
        heard, ahead = "a heard segment, long " * 25, "the look-ahead segment " * 25
        first, newcomer = Sink(), Sink()
        sched.submit([heard, ahead], params, first)  # seq 0 (heard) and seq 1 (look-ahead): both places
        await engine.run_steps(2)  # seq 0 alone, then, 8.5 s ahead, seq 0 and seq 1
        assert [rec.seq_ids for rec in engine.steps] == [(0,), (0, 1)]
        sched.submit(["newcomer."], SynthesisParams(seed=6), newcomer)  # seq 2
        for _ in range(3):  # the step in flight when it came, then the next boundary, with a margin
            await engine.run_steps(1)
        steps = [rec.seq_ids for rec in engine.steps]
        assert any(2 in ids for ids in steps)  # without the rule: not before seq 0 or 1 ends (50 steps)
        assert ("drop", 1) in engine.events and ("finish", 0) not in engine.events
        engine.gated = False
        engine.permits.release(1)  # a step may be waiting for one
        await wait_all([first, newcomer])
    assert first.end.reason == newcomer.end.reason == "complete"
    # The look-ahead segment was made afresh with its own seed offset: the stream's audio is exactly
    # its two segments', in order, with nothing of the run that gave its place up.
    again = [r for r in engine.added if r.text == ahead]
    assert [r.seed_offset for r in again] == [1, 1] and again[1].seq_id == 3
    expected = np.concatenate([expected_audio(r) for r in engine.added if r.seq_id in (0, 3)])
    audio = np.concatenate([e.samples for e in first.events if isinstance(e, Audio)])
    assert np.array_equal(audio, expected)


async def test_max_batch_0_takes_the_engines_slots_as_the_batch_limit() -> None:
    """``--max-batch 0``: the batch limit is the slots the loaded engine states (CUDA: from free memory)."""
    engine = FakeEngine(step_base_s=0.0, step_per_row_s=0.0)
    engine._info = dataclasses.replace(engine.info, max_batch=3)
    async with run_core(engine, max_batch=0, lookahead=0, max_wait_s=0.05) as sched:
        sinks = [Sink() for _ in range(5)]
        for i, sink in enumerate(sinks):
            sched.submit([f"stream {i} speaks for a while."], SynthesisParams(seed=i), sink)
        await wait_all(sinks)
    assert all(s.end.reason == "complete" for s in sinks)
    assert max(len(rec.seq_ids) for rec in engine.steps) == 3
