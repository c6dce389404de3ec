"""The long-lived inference loop: one thread owns the engine and batches every stream.

The asyncio side calls :meth:`Scheduler.submit` and gets a
:class:`ScheduledStream`; commands (new stream, new segment, end of input,
cancel) go through a thread-safe intake list and wake the loop. The loop
thread alternates intake and one engine step (iteration-level batching):
after every token block it drops cancelled and finished sequences, admits
waiting ones up to the batch limit and hands each stream's new audio to the
event loop with ``call_soon_threadsafe``. A newcomer therefore waits for one
block, not for a whole batch.

A stream is a list of text segments. Segment k+1 is queued as soon as
segment k runs (``lookahead``), so it is generating before k's audio runs
out; its audio is held back until k is finished, so the stream stays in
order. Look-ahead sequences queue behind the first segments of other
streams, so one stream never takes more than its share of the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from server.engine.base import (
    Engine,
    EngineInfo,
    EngineOutOfMemory,
    SequenceRequest,
    StepResult,
    SynthesisParams,
)
from server.metrics import Metrics
from server.protocol import ProtocolError
from server.stream_order import (
    EventSink,
    StreamEnded,
    StreamEvent,
    StreamOrder,
)

log = logging.getLogger(__name__)


class Overloaded(ProtocolError):
    """The intake queue is full."""

    def __init__(self, retry_after_ms: int) -> None:
        super().__init__(
            "overloaded",
            "the server is at capacity; retry later",
            retry_after_ms=retry_after_ms,
        )


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Tuning of the loop; see ``server.config.Settings`` for the documented flags."""

    max_batch: int = 16
    max_wait_s: float = 0.005
    max_queue: int = 256
    lookahead: int = 1
    max_tokens_per_segment: int = 2048
    breaker_threshold: int = 5
    breaker_probe_interval_s: float = 2.0
    oom_recovery_steps: int = 50


# --- loop-thread state ------------------------------------------------------


@dataclass(eq=False)
class _Waiting:
    stream: StreamOrder
    segment: int
    submitted: float


Command = Callable[[], None]


class ScheduledStream:
    """The asyncio side's handle on one submitted stream (methods are thread-safe)."""

    def __init__(self, scheduler: Scheduler, stream_id: int) -> None:
        self._scheduler = scheduler
        self.stream_id = stream_id

    def append_segment(self, text: str) -> None:
        """Queue one more segment (incremental streams)."""
        self._scheduler._command(lambda: self._scheduler._on_append(self.stream_id, text))

    def end_input(self) -> None:
        """No more segments will be appended."""
        self._scheduler._command(lambda: self._scheduler._on_end_input(self.stream_id))

    def cancel(self) -> None:
        """Stop generating; the engine work is freed at the next block boundary."""
        self._scheduler._command(lambda: self._scheduler._on_cancel(self.stream_id))


class Scheduler:
    """Owns the engine on one thread and serves every stream through it."""

    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        *,
        config: SchedulerConfig,
        metrics: Metrics,
        warmup: bool = True,
    ) -> None:
        self._engine_factory = engine_factory
        self.config = config
        self._metrics = metrics
        self._warmup = warmup
        self._engine: Engine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cond = threading.Condition()
        self._intake: list[Command] = []
        self._stop = False
        self._stopped = False  # the loop thread has ended (set by it, read by submit)
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self._order = itertools.count()
        # Loop-thread state.
        self._streams: dict[int, StreamOrder] = {}
        self._waiting: list[tuple[int, int, _Waiting]] = []  # heap of (priority, order, entry)
        self._running: dict[int, StreamOrder] = {}  # seq_id -> stream, in admission order
        self._batch_limit = config.max_batch
        self._ok_steps_since_oom = 0
        self._consecutive_failures = 0
        self._breaker_opened_at: float | None = None
        # Facts read by other threads (plain attribute reads are atomic in CPython).
        self.ready = threading.Event()
        self.startup_error: BaseException | None = None
        self.heartbeat = time.monotonic()
        self._pending_submits = 0
        self._waiting_count = 0
        self.seconds_per_block = 0.05
        self.engine_info_voices: tuple[str, ...] = ()
        self.engine_info: EngineInfo | None = None  # set once the engine is built

    # --- lifecycle (event loop side) ---------------------------------------

    async def start(self) -> None:
        """Start the loop thread; returns once the engine is loaded (warm-up may continue).

        Raises:
            BaseException: whatever loading the engine raised.
        """
        self._loop = asyncio.get_running_loop()
        loaded = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(loaded,), name="inference", daemon=True)
        self._thread.start()
        await asyncio.to_thread(loaded.wait)
        if self.startup_error is not None:
            await asyncio.to_thread(self._thread.join)
            raise self.startup_error

    async def stop(self) -> None:
        """Stop the loop thread after its current step and release the engine."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def engine(self) -> Engine:
        """The engine (tests inspect the fake engine's logs through this)."""
        assert self._engine is not None, "scheduler not started"
        return self._engine

    @property
    def alive(self) -> bool:
        """The loop thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def breaker_open(self) -> bool:
        """Too many consecutive failed steps; cleared by a successful probe or step."""
        return self._breaker_opened_at is not None

    def validate_voice(self, voice: str) -> bool:
        """Thread-safe: engines answer from immutable data."""
        return self.engine.validate_voice(voice)

    # --- submission (event loop side) --------------------------------------

    def submit(
        self,
        segments: list[str],
        params: SynthesisParams,
        sink: EventSink,
        *,
        incremental: bool = False,
    ) -> ScheduledStream:
        """Queue a stream; ``sink`` gets its events on the event loop, in order.

        Raises:
            Overloaded: the queue already holds ``max_queue`` sequences.
        """
        if self._stopped:
            raise ProtocolError("internal", "the inference loop is not running")
        if self.breaker_open:  # /ready fails meanwhile, so a load balancer routes elsewhere
            raise Overloaded(int(self.config.breaker_probe_interval_s * 1000))
        if self.queued >= self.config.max_queue:
            raise Overloaded(self.retry_after_ms())
        stream = StreamOrder(
            stream_id=next(self._ids),
            params=params,
            sink=sink,
            segments=list(segments),
            input_closed=not incremental,
        )
        with self._cond:
            self._pending_submits += 1
            self._intake.append(lambda: self._on_submit(stream))
            self._cond.notify()
        return ScheduledStream(self, stream.stream_id)

    @property
    def queued(self) -> int:
        """Sequences waiting for a batch slot, including submissions not yet taken in."""
        return self._waiting_count + self._pending_submits

    def retry_after_ms(self) -> int:
        """When a refused stream could expect a slot: queued batches times block time."""
        batches_ahead = 1 + self.queued // max(1, self._batch_limit)
        # A sequence needs roughly ten blocks; a conservative floor avoids retry storms.
        return max(250, int(batches_ahead * 10 * self.seconds_per_block * 1000))

    def _command(self, command: Command) -> None:
        with self._cond:
            self._intake.append(command)
            self._cond.notify()

    # --- loop thread ---------------------------------------------------------

    def _run(self, loaded: threading.Event) -> None:
        try:
            self._engine = self._engine_factory()
            self.engine_info_voices = self._engine.info.voices
            self.engine_info = self._engine.info
            self._metrics.kv_cache_bytes.set(int(self._engine.info.extra.get("kv_cache_bytes", 0)))
        except BaseException as exc:  # reported to start()'s caller
            self.startup_error = exc
            loaded.set()
            return
        loaded.set()
        try:
            if self._warmup:
                self._warm_engine()
            self.ready.set()
            while self._iterate():
                pass
        except BaseException:
            log.exception("inference loop crashed")
            raise
        finally:
            self.ready.clear()
            self._stopped = True
            self._fail_everything()
            self._engine.close()

    def _warm_engine(self) -> None:
        """The engine's own warm-up; a failure opens the breaker instead of killing the loop."""
        try:
            self.engine.warmup()
        except Exception:
            log.exception("engine warm-up failed; the breaker stays open until a probe succeeds")
            self._open_breaker()

    def _open_breaker(self) -> None:
        """Stop taking work: ``/ready`` fails, new streams get ``overloaded``, waiting ones fail now."""
        self._breaker_opened_at = time.monotonic()
        self._metrics.breaker_open.set(1)
        for _, _, entry in list(self._waiting):
            self._fail_stream(entry.stream, "the model is failing; retry later or elsewhere")

    def _iterate(self) -> bool:
        """One round: intake, admission, one step. Returns False to stop."""
        self.heartbeat = time.monotonic()
        with self._cond:
            if self._stop:
                return False
            if not self._intake and not self._running and not self._waiting:
                self._cond.wait(timeout=1.0)
            commands, self._intake = self._intake, []
        for command in commands:
            command()
        if self._breaker_opened_at is not None and not self._probe():
            return True
        if not self._running and self._waiting:
            self._gather_first_batch()
        self._admit()
        if self._running:
            self._step(list(self._running))
        return True

    def _gather_first_batch(self) -> None:
        """Idle → busy: wait up to ``max_wait`` for more requests to share the first step."""
        deadline = min(entry.submitted for _, _, entry in self._waiting) + self.config.max_wait_s
        while len(self._waiting) < self._batch_limit:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            with self._cond:
                if not self._intake:
                    self._cond.wait(timeout=remaining)
                commands, self._intake = self._intake, []
            for command in commands:
                command()

    def _admit(self) -> None:
        engine = self.engine
        while self._waiting and len(self._running) < self._batch_limit:
            _, _, entry = heapq.heappop(self._waiting)
            stream = entry.stream
            if stream.ended:
                continue
            seq_id = next(self._seq_ids)
            request = SequenceRequest(
                seq_id=seq_id,
                text=stream.segments[entry.segment],
                params=stream.params,
                max_tokens=self.config.max_tokens_per_segment,
                seed_offset=entry.segment,
            )
            try:
                engine.add(request)
            except Exception as exc:
                log.warning("engine refused a sequence: %s", exc)
                self._fail_stream(stream, "the model could not take this text")
                continue
            self._metrics.queue_wait.observe(time.monotonic() - entry.submitted)
            stream.live_seqs[seq_id] = entry.segment
            self._running[seq_id] = stream
            self._queue_lookahead(stream)
        self._count_waiting()
        self._metrics.running_sequences.set(len(self._running))

    def _count_waiting(self) -> None:
        self._waiting_count = len(self._waiting)
        self._metrics.queue_depth.set(self.queued)

    def _queue_lookahead(self, stream: StreamOrder) -> None:
        """Queue the stream's next segments as its look-ahead allows."""
        for index in stream.segments_to_queue(self.config.lookahead):
            # Priority 0 for the segment a listener is waiting for, 1 for look-ahead.
            priority = 0 if index == stream.emit_index else 1
            entry = _Waiting(stream, index, time.monotonic())
            heapq.heappush(self._waiting, (priority, next(self._order), entry))
        self._count_waiting()
        stream.maybe_complete()

    def _step(self, seq_ids: list[int]) -> None:
        engine = self.engine
        started = time.monotonic()
        try:
            results = engine.step(seq_ids)
        except EngineOutOfMemory:
            self._on_oom(seq_ids)
            return
        except Exception as exc:
            self._on_step_failure(seq_ids, exc)
            return
        elapsed = time.monotonic() - started
        self._consecutive_failures = 0
        self._grow_batch_limit()
        self.seconds_per_block = 0.8 * self.seconds_per_block + 0.2 * elapsed
        self._metrics.block_time.observe(elapsed)
        self._metrics.batch_size.observe(len(seq_ids))
        memory_allocated = getattr(engine, "memory_allocated", None)  # optional engine capability
        if callable(memory_allocated):
            self._metrics.gpu_memory_bytes.set(memory_allocated())
        # One hand-off per stream per step keeps cross-thread calls few.
        deliveries: dict[StreamOrder, list[StreamEvent]] = {}
        for result in results:
            self._route(result, deliveries)
        for stream, events in deliveries.items():
            self._deliver(stream.sink, events)

    def _route(self, result: StepResult, deliveries: dict[StreamOrder, list[StreamEvent]]) -> None:
        stream = self._running.get(result.seq_id)
        if stream is None:
            return
        segment = stream.live_seqs[result.seq_id]
        self._metrics.tokens.inc(result.tokens)
        self._metrics.audio_seconds.inc(len(result.audio) / 24_000)
        if result.finished:
            del self._running[result.seq_id]
            del stream.live_seqs[result.seq_id]
        if stream.ended:
            return
        events = deliveries.setdefault(stream, [])
        stream.on_audio(segment, result.audio, result.finished, events)
        if result.finished:
            self._queue_lookahead(stream)
            if stream.maybe_complete():
                events.append(StreamEnded("complete"))
                self._forget(stream)

    # --- commands (run on the loop thread) ------------------------------------

    def _on_submit(self, stream: StreamOrder) -> None:
        self._streams[stream.stream_id] = stream
        with self._cond:
            self._pending_submits -= 1
        self._queue_lookahead(stream)
        if stream.ended:  # an empty closed stream completes at once
            self._deliver(stream.sink, [StreamEnded("complete")])
            self._forget(stream)

    def _on_append(self, stream_id: int, text: str) -> None:
        stream = self._streams.get(stream_id)
        if stream is None or stream.ended or stream.input_closed:
            return
        stream.segments.append(text)
        self._queue_lookahead(stream)

    def _on_end_input(self, stream_id: int) -> None:
        stream = self._streams.get(stream_id)
        if stream is None or stream.ended:
            return
        stream.input_closed = True
        if stream.maybe_complete():
            self._deliver(stream.sink, [StreamEnded("complete")])
            self._forget(stream)

    def _on_cancel(self, stream_id: int) -> None:
        stream = self._streams.get(stream_id)
        if stream is None or stream.ended:
            return
        stream.ended = True
        self._deliver(stream.sink, [StreamEnded("cancelled")])
        self._forget(stream)

    # --- failures ------------------------------------------------------------

    def _on_oom(self, seq_ids: list[int]) -> None:
        self._metrics.engine_failures.labels(kind="oom").inc()
        empty_cache = getattr(self.engine, "empty_cache", None)
        if callable(empty_cache):
            empty_cache()
        if len(seq_ids) <= 1:
            self._on_step_failure(seq_ids, MemoryError("out of memory with a batch of one"))
            return
        self._batch_limit = max(1, len(seq_ids) // 2)
        self._ok_steps_since_oom = 0
        log.warning("out of memory at batch %d; batch limit now %d", len(seq_ids), self._batch_limit)
        # Retry at once with the first half; the rest stay paused in the engine.
        self._step(seq_ids[: self._batch_limit])

    def _grow_batch_limit(self) -> None:
        if self._batch_limit >= self.config.max_batch:
            return
        self._ok_steps_since_oom += 1
        if self._ok_steps_since_oom >= self.config.oom_recovery_steps:
            self._batch_limit += 1
            self._ok_steps_since_oom = 0

    def _on_step_failure(self, seq_ids: list[int], exc: BaseException) -> None:
        log.error("engine step failed for %d sequences: %r", len(seq_ids), exc)
        self._metrics.engine_failures.labels(kind="error").inc()
        self._consecutive_failures += 1
        # The breaker opens first, so that whoever hears of these failures sees it open.
        if self._consecutive_failures >= self.config.breaker_threshold and self._breaker_opened_at is None:
            log.error("breaker open after %d consecutive failures", self._consecutive_failures)
            self._open_breaker()
        for seq_id in seq_ids:
            stream = self._running.get(seq_id)
            if stream is not None:
                self._fail_stream(stream, "the model failed while generating this stream")

    def _probe(self) -> bool:
        """While the breaker is open, run a warm-up as a probe every few seconds."""
        assert self._breaker_opened_at is not None
        if time.monotonic() - self._breaker_opened_at < self.config.breaker_probe_interval_s:
            with self._cond:
                self._cond.wait(timeout=0.05)
            return False
        try:
            self.engine.warmup()
        except Exception as exc:
            log.warning("breaker probe failed: %r", exc)
            self._breaker_opened_at = time.monotonic()
            return False
        log.info("breaker closed: probe succeeded")
        self._breaker_opened_at = None
        self._consecutive_failures = 0
        self._metrics.breaker_open.set(0)
        return True

    def _fail_stream(self, stream: StreamOrder, message: str) -> None:
        if stream.ended:
            return
        stream.ended = True
        error = ProtocolError("engine_error", message)
        self._deliver(stream.sink, [StreamEnded("error", error)])
        self._forget(stream)

    def _forget(self, stream: StreamOrder) -> None:
        """Drop every engine sequence of an ended stream and its bookkeeping."""
        stream.ended = True
        for seq_id in list(stream.live_seqs):
            self.engine.drop(seq_id)
            self._running.pop(seq_id, None)
        stream.live_seqs.clear()
        stream.held.clear()
        self._streams.pop(stream.stream_id, None)
        before = len(self._waiting)
        self._waiting = [item for item in self._waiting if item[2].stream is not stream]
        if len(self._waiting) != before:
            heapq.heapify(self._waiting)
            self._count_waiting()

    def _fail_everything(self) -> None:
        """The loop is ending: every stream still here, or still in the intake, gets an error."""
        with self._cond:
            commands, self._intake = self._intake, []
        for command in commands:
            command()
        for stream in list(self._streams.values()):
            self._fail_stream(stream, "the inference loop stopped")

    def _deliver(self, sink: EventSink, events: list[StreamEvent]) -> None:
        loop = self._loop
        if loop is None or not events:
            return
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(sink, events)
