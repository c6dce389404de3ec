"""The inference loop: one thread owns the engine and runs it for every stream.

:class:`EngineCore` takes typed commands (``server.core.events``) from any
thread and loops on its own: take the commands in, ask the
:class:`~server.core.policy.SchedulingPolicy` for the next batch, run it on the
engine (drop, add, one step of a token block), feed the outcome back to the
policy, and hand the events it releases to ``emit`` in one batch. A newcomer
therefore waits for the step in flight, not for a whole batch
(iteration-level batching); and an engine that can end a block early (an
``interrupt`` attribute, as the ChatTTS engine has) ends it at the next quantum
boundary once a command that brings or frees work (add, append, cancel) waits:
it asks ``interrupt`` only between quanta (its ``quantum_tokens`` token steps, 4
on CUDA and 1 on the CPU), never inside one, so the newcomer waits at most one
quantum, not a block (two where the engine overlaps its quanta, ``--overlap-quanta``:
the quantum launched before the read that saw the command still runs). The engine is
created, warmed up, stepped and closed on this thread only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import assert_never

from server.core.events import (
    Add,
    Append,
    Cancel,
    Capacity,
    Command,
    CoreEvent,
    EncodeVoice,
    EndInput,
    Heartbeat,
    Loaded,
    LoadFailed,
    Ready,
    Shutdown,
    Stopped,
    VoiceEncoded,
)
from server.core.meters import CoreMetrics
from server.core.policy import (
    STOPPED_MESSAGE as STOPPED,
)
from server.core.policy import (
    Batch,
    Outcome,
    OutOfMemory,
    PolicyConfig,
    Probed,
    SchedulingPolicy,
    StepFailed,
    Stepped,
)
from server.engine_api import Engine, EngineOutOfMemory
from server.errors import StartupError

log = logging.getLogger(__name__)

#: Commands that end a running block early: they bring work a listener waits for, or free some.
URGENT_COMMANDS = (Add, Append, Cancel)
#: An idle loop wakes this often to say it is alive.
HEARTBEAT_S = 1.0
Emit = Callable[[list[CoreEvent]], None]


class EngineCore:
    """Commands in, events out; owns the engine and the policy on the thread that calls :meth:`run`."""

    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        config: PolicyConfig,
        *,
        emit: Emit,
        metrics: CoreMetrics,
        warmup: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine_factory = engine_factory
        self._policy = SchedulingPolicy(config)
        self._sink = emit
        self._metrics = metrics
        self._warmup = warmup
        self._clock = clock
        self._cond = threading.Condition()
        self._intake: list[Command] = []
        self._urgent = False  # the intake holds an add, append or cancel (read without the lock)
        self._encodes: deque[EncodeVoice] = deque()  # one runs per round, between steps
        self._stop = False
        self._adds_taken = 0
        self._published: Capacity | None = None
        self._last_emit = clock()
        self.engine: Engine | None = None  # set on the loop thread once loaded (tests read it)

    def _emit(self, events: list[CoreEvent]) -> None:
        self._last_emit = self._clock()
        self._sink(events)

    def send(self, command: Command) -> None:
        """Queue a command (any thread); the loop takes it in before its next step."""
        with self._cond:
            self._intake.append(command)
            self._urgent = self._urgent or isinstance(command, URGENT_COMMANDS)
            self._cond.notify()

    def _command_waits(self) -> bool:
        """The engine's ``interrupt``: an add, append or cancel waits (a bool read, no lock)."""
        return self._urgent

    def shutdown(self) -> None:
        """Ask the loop to stop after its current step (any thread)."""
        with self._cond:
            self._stop = True
            self._cond.notify()

    # --- the thread --------------------------------------------------------------------

    def run(self) -> None:
        """Load the engine, warm it up, loop until stopped, close it; every stream left fails."""
        try:
            engine = self._engine_factory()
        except StartupError as exc:
            self._emit([LoadFailed(str(exc))])
            return
        except Exception as exc:
            log.debug("engine failed to load", exc_info=True)
            cause = " ".join(f"{type(exc).__name__}: {exc}".split())
            self._emit([LoadFailed(f"the engine failed to load (--engine): {cause}")])
            return
        self.engine = engine
        self._policy.fit_engine(engine.info.max_batch)
        self._metrics.kv_cache_bytes.set(int(engine.info.extra.get("kv_cache_bytes", 0)))
        self._emit([Loaded(engine.info)])
        try:
            if self._warmup:
                self._warm(engine)
            self._observe_memory(engine)
            if hasattr(engine, "interrupt"):  # optional engine capability; not during warm-up
                engine.interrupt = self._command_waits
            self._emit([Ready()])
            wait: float | None = 0.0
            while (wait := self._iterate(engine, wait)) is not None:
                pass
        except BaseException:
            log.exception("inference loop crashed")
            raise
        finally:
            self._finish(engine)

    def _warm(self, engine: Engine) -> None:
        """The engine's own warm-up; a failure opens the breaker instead of killing the loop."""
        try:
            engine.warmup()
        except Exception:
            log.exception("engine warm-up failed; the breaker stays open until a probe succeeds")
            self._publish(self._policy.open_breaker(self._clock()))

    def _iterate(self, engine: Engine, wait: float | None) -> float | None:
        """One round: take commands in (waiting up to ``wait`` s for one), then run one batch.

        Returns:
            How long the next round may wait for a command (None: stop).
        """
        commands = self._take(wait)
        if commands is None:
            return None
        events = [event for command in commands for event in self._apply(command)]
        if self._encodes:
            events.append(self._encode(engine, self._encodes.popleft()))
        if events:  # acknowledgements (cancelled, completed, voices) need not wait for the step
            self._emit(events)
            events = []
        now = self._clock()
        batch = self._policy.schedule(now)
        for seq_id in batch.drop:
            engine.drop(seq_id)
        if not batch.idle:
            outcome = self._run(engine, batch, events)
            events += self._policy.update(batch, outcome, self._clock())
        self._observe_memory(engine)
        self._publish(events)
        if self._clock() - self._last_emit >= HEARTBEAT_S:  # idle, or probing an open breaker
            self._emit([Heartbeat()])
        if not batch.idle or self._encodes:
            return 0.0
        if batch.wait_until is not None:
            return max(0.0, batch.wait_until - self._clock())
        return HEARTBEAT_S

    def _take(self, wait: float | None) -> list[Command] | None:
        with self._cond:
            if not self._intake and not self._stop and wait:
                self._cond.wait(timeout=wait)
            if self._stop:
                return None
            commands, self._intake, self._urgent = self._intake, [], False
        return commands

    def _apply(self, command: Command) -> list[CoreEvent]:
        policy = self._policy
        match command:
            case Add():
                self._adds_taken += 1
                now = self._clock()
                return list(
                    policy.add(
                        command.stream_id,
                        command.segments,
                        command.params,
                        input_closed=command.input_closed,
                        now=now,
                        client=command.client,
                        first_segment=command.first_segment,
                    )
                )
            case Append(stream_id=stream_id, text=text):
                return list(policy.append(stream_id, text, self._clock()))
            case EndInput(stream_id=stream_id):
                return list(policy.end_input(stream_id))
            case Cancel(stream_id=stream_id):
                return list(policy.cancel(stream_id))
            case EncodeVoice():
                self._encodes.append(command)
                return []
            case Shutdown():
                self._stop = True  # commands after it are not taken
                return []
            case _:
                assert_never(command)

    def _encode(self, engine: Engine, command: EncodeVoice) -> VoiceEncoded:
        """A recording's codes (it blocks the loop for one encoder pass, like a step would)."""
        try:
            codes = engine.encode_voice(command.audio, command.transcript)
        except ValueError as exc:
            return VoiceEncoded(command.request_id, None, str(exc))
        except Exception as exc:
            log.error("encoding a voice failed: %r", exc)
            self._metrics.engine_failures.labels("error").inc()
            return VoiceEncoded(command.request_id, None, "the model failed to encode the recording", True)
        return VoiceEncoded(command.request_id, codes)

    def _run(self, engine: Engine, batch: Batch, events: list[CoreEvent]) -> Outcome:
        """Add the batch's new sequences and step it (or probe); returns what happened."""
        if batch.probe:
            return Probed(self._probe(engine))
        refused = False
        for request, waited in zip(batch.add, batch.waited_s, strict=True):
            if not self._policy.running([request.seq_id]):
                continue  # its stream failed on an earlier refusal in this batch
            try:
                engine.add(request)
            except Exception as exc:
                log.warning("engine refused a sequence: %s", exc)
                events += self._policy.refuse(request.seq_id)
                refused = True
                continue
            self._metrics.queue_wait.observe(waited)
        # A refused stream's other sequences are dropped by the next batch; they do not step now.
        step = self._policy.running(batch.step) if refused else batch.step
        if not step:
            return Stepped((), 0.0)
        return self._step(engine, list(step))

    def _step(self, engine: Engine, seq_ids: list[int]) -> Outcome:
        metrics = self._metrics
        started = self._clock()
        try:
            results = engine.step(seq_ids)
        except EngineOutOfMemory:
            metrics.engine_failures.labels("oom").inc()
            empty_cache = getattr(engine, "empty_cache", None)  # optional engine capability
            if callable(empty_cache):
                empty_cache()
            log.warning("out of memory at batch %d", len(seq_ids))
            return OutOfMemory()
        except Exception as exc:
            log.error("engine step failed for %d sequences: %r", len(seq_ids), exc)
            metrics.engine_failures.labels("error").inc()
            return StepFailed(repr(exc))
        elapsed = self._clock() - started
        metrics.block_time.observe(elapsed)
        metrics.batch_size.observe(len(seq_ids))
        metrics.block_tokens.observe(max((result.tokens for result in results), default=0))
        for result in results:
            metrics.tokens.inc(result.tokens)
            metrics.audio_seconds.inc(len(result.audio) / engine.info.sample_rate)
        return Stepped(results, elapsed)

    def _observe_memory(self, engine: Engine) -> None:
        """The gauges the engine can report (optional capabilities: memory, its host side's time)."""
        memory_allocated = getattr(engine, "memory_allocated", None)
        if callable(memory_allocated):
            self._metrics.gpu_memory_bytes.set(memory_allocated())
        kv_resident_bytes = getattr(engine, "kv_resident_bytes", None)
        if callable(kv_resident_bytes):
            self._metrics.kv_resident_bytes.set(kv_resident_bytes())
        host_time = getattr(engine, "host_time", None)
        if callable(host_time):
            cpu_s, held_s = host_time()
            self._metrics.engine_host_cpu.set(cpu_s)
            self._metrics.engine_host_held.set(held_s)

    def _probe(self, engine: Engine) -> bool:
        """The open breaker's probe: one warm-up run."""
        try:
            engine.warmup()
        except Exception as exc:
            log.warning("breaker probe failed: %r", exc)
            return False
        log.info("breaker closed: probe succeeded")
        return True

    def _publish(self, events: list[CoreEvent]) -> None:
        """Hand the round's events over, with the admission state when it changed."""
        policy = self._policy
        self._metrics.running_sequences.set(policy.running_count)
        self._metrics.breaker_open.set(1 if policy.breaker_open else 0)
        capacity = Capacity(policy.admission(), self._adds_taken)
        if capacity != self._published:
            self._published = capacity
            events.append(capacity)
        if events:
            self._emit(events)

    def _finish(self, engine: Engine) -> None:
        """The loop is ending: streams still here, or still in the intake, fail; the engine closes."""
        with self._cond:
            commands, self._intake, self._urgent = self._intake, [], False
        events = [event for command in commands for event in self._apply(command)]
        events += [VoiceEncoded(c.request_id, None, STOPPED, True) for c in self._encodes]
        self._encodes.clear()
        events += self._policy.stop()
        try:
            engine.close()
        finally:
            self._emit([*events, Stopped()])
