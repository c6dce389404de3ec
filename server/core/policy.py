"""The scheduling policy: which sequences the next engine step runs, and what the results mean.

A pure object: no threads, no engine, no clock (``now`` is passed in), so every
rule is tested by building a policy, calling :meth:`SchedulingPolicy.schedule`,
feeding it results and asserting (``tests/unit/test_policy.py``). The engine
core (``server.core.engine_core``) drives it::

    batch = policy.schedule(now)                  # drop, add and step (or probe, or wait)
    outcome = ...                                 # the core runs the batch on the engine
    events = policy.update(batch, outcome, now)   # the streams' events, in order

A stream is a list of text segments; each segment is one engine sequence. The rules:

- **Look-ahead priority**: a stream's segment being heard (a new stream's first
  one too) ranks before every look-ahead segment, so a stream's look-ahead
  never takes a slot that another stream's listener waits for.
- **Look-ahead waits for a lead**: a look-ahead segment takes part in a step only
  while its stream's audio is ``lookahead_lead_s`` ahead of real time (or a heard
  segment waits for a slot; 0: always): on a CPU that barely keeps up, a second row slows the
  segment being heard below real time, for audio that nobody can hear yet.
- **Look-ahead yields its place**: while every batch place is taken and a heard
  segment (a new stream's first one, or one whose listener waits for it) waits, a
  running look-ahead segment whose stream is ``lookahead_lead_s`` ahead of real
  time gives its place up at the next block boundary: it is dropped from the engine
  and queued again as look-ahead, to be generated afresh from its start.
- **Per-stream share**: a stream has at most ``1 + lookahead`` unfinished
  segments queued or running.
- **Held-segment cap**: segments that finish ahead of their turn are held (their
  audio waits); no more look-ahead is queued while more than ``1 + lookahead``
  are held.
- **Fair turns**: waiting sequences leave by priority, then round-robin over the
  clients that asked for them (:class:`~server.core.fairqueue.FairQueue`), so one
  client's backlog never stands in front of everyone else.
- **Admission** (:func:`server.core.admission.refusal`): a new stream is refused while ``max_queue``
  sequences wait, with a retry estimate, and while the breaker is open; past
  ``max_queue`` a client still under its fair share of the queue is admitted (up
  to twice ``max_queue`` in all), so one client cannot keep the others out.
- **Out of memory**: the batch limit halves and the first half runs at once (the
  rest stay paused in the engine); it grows back by one every
  ``oom_recovery_steps`` good steps (:class:`~server.core.health.StepHealth`).
- **Breaker**: ``breaker_threshold`` consecutive failed steps open it; the
  streams waiting for a slot fail at once, new ones are refused, and a probe
  runs every ``breaker_probe_interval_s`` until one succeeds (``StepHealth``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import assert_never

from server.core.batch import (
    DEFAULT_MAX_BATCH,
    INITIAL_SECONDS_PER_BLOCK,
    Batch,
    Outcome,
    OutOfMemory,
    PolicyConfig,
    Probed,
    StepFailed,
    Stepped,
)
from server.core.events import Admission, BreakerChanged, CoreEvent, Ended, EndReason, StreamEvent
from server.core.fairqueue import FairQueue, Waiting
from server.core.health import StepHealth
from server.core.plan import StreamPlan
from server.engine_api import SequenceRequest, StepResult, SynthesisParams, segment_token_cap

__all__ = [
    "BREAKER_MESSAGE",
    "INITIAL_SECONDS_PER_BLOCK",
    "Batch",
    "OutOfMemory",
    "Outcome",
    "PolicyConfig",
    "Probed",
    "SchedulingPolicy",
    "StepFailed",
    "Stepped",
]

BREAKER_MESSAGE = "the model is failing; retry later or elsewhere"
FAILED_MESSAGE = "the model failed while generating this stream"
REFUSED_MESSAGE = "the model could not take this text"
STOPPED_MESSAGE = "the inference loop stopped"


class SchedulingPolicy:
    """Waiting and running sequences, priorities, batch limit and breaker; no I/O, no clock."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self._plans: dict[int, StreamPlan] = {}
        self._waiting = FairQueue()
        self._running: dict[int, StreamPlan] = {}  # seq_id -> stream, in admission order
        self._drops: list[int] = []
        self._seq_ids = itertools.count()
        self._health = StepHealth(
            max_batch=config.max_batch,
            breaker_threshold=config.breaker_threshold,
            probe_interval_s=config.breaker_probe_interval_s,
            oom_recovery_steps=config.oom_recovery_steps,
        )
        #: Moving average of one engine step (for the retry estimate).
        self.seconds_per_block = INITIAL_SECONDS_PER_BLOCK

    # --- state -----------------------------------------------------------------------

    @property
    def waiting_count(self) -> int:
        """Sequences waiting for a batch slot."""
        return len(self._waiting)

    @property
    def running_count(self) -> int:
        """Sequences admitted to the engine (some may be paused after an out-of-memory)."""
        return len(self._running)

    @property
    def batch_limit(self) -> int:
        """Sequences one step may hold now (``max_batch`` until an out-of-memory lowers it)."""
        return self._health.batch_limit

    @property
    def breaker_open(self) -> bool:
        """Too many consecutive failed steps; closed by a successful probe."""
        return self._health.breaker_open

    def admission(self) -> Admission:
        """The state :func:`refusal` decides on."""
        return Admission(
            waiting=len(self._waiting),
            batch_limit=self.batch_limit,
            seconds_per_block=self.seconds_per_block,
            breaker_open=self.breaker_open,
            by_client=self._waiting.by_client(),
        )

    def running(self, seq_ids: Iterable[int]) -> tuple[int, ...]:
        """Those of ``seq_ids`` that still run (a refused add ends its stream)."""
        return tuple(seq_id for seq_id in seq_ids if seq_id in self._running)

    def fit_engine(self, engine_slots: int | None) -> None:
        """Once the engine is loaded: ``max_batch`` 0 (``--max-batch 0``) becomes the engine's slots.

        ``engine_slots`` is :attr:`~server.engine_api.EngineInfo.max_batch` (on CUDA sized from
        free memory); an engine that states none gets :data:`DEFAULT_MAX_BATCH`.
        """
        if self.config.max_batch == 0:
            self.config = replace(self.config, max_batch=engine_slots or DEFAULT_MAX_BATCH)
            self._health.max_batch = self._health.batch_limit = self.config.max_batch

    # --- commands --------------------------------------------------------------------

    def add(
        self,
        stream_id: int,
        segments: Sequence[str],
        params: SynthesisParams,
        *,
        input_closed: bool,
        now: float,
        client: str = "",
        first_segment: int = 0,
    ) -> list[StreamEvent]:
        """A new stream (``client`` asked; ``first_segment``: its seed offset); empty, closed: done now."""
        plan = StreamPlan(
            stream_id,
            params,
            list(segments),
            input_closed=input_closed,
            client=client,
            first_segment=first_segment,
        )
        if self.breaker_open:  # admitted just before the breaker opened: it would wait for nothing
            return [Ended(stream_id, "error", BREAKER_MESSAGE)]
        self._plans[stream_id] = plan
        return self._queue(plan, now)

    def append(self, stream_id: int, text: str, now: float) -> list[StreamEvent]:
        """One more segment for an open stream."""
        plan = self._plans.get(stream_id)
        if plan is None or plan.input_closed:
            return []
        plan.segments.append(text)
        return self._queue(plan, now)

    def end_input(self, stream_id: int) -> list[StreamEvent]:
        """No more segments: the stream completes once those it has are emitted."""
        plan = self._plans.get(stream_id)
        if plan is None:
            return []
        plan.input_closed = True
        return self._end(plan, "complete") if plan.complete else []

    def cancel(self, stream_id: int) -> list[StreamEvent]:
        """Stop the stream; its running sequences are dropped by the next batch."""
        plan = self._plans.get(stream_id)
        return [] if plan is None else self._end(plan, "cancelled")

    def stop(self) -> list[StreamEvent]:
        """The loop is ending: every stream still here fails."""
        events: list[StreamEvent] = []
        for plan in list(self._plans.values()):
            events += self._end(plan, "error", STOPPED_MESSAGE)
        return events

    # --- one step --------------------------------------------------------------------

    def schedule(self, now: float) -> Batch:
        """Admit waiting sequences up to the batch limit and choose the next step."""
        drop = tuple(self._drops)
        self._drops.clear()
        if (due := self._health.probe_due) is not None:
            return Batch(drop=drop, probe=True) if now >= due else Batch(drop=drop, wait_until=due)
        if not self._running and 0 < len(self._waiting) < self.batch_limit:
            # Idle → busy: wait up to max_wait for more streams to share the first step.
            deadline = self._waiting.oldest_since() + self.config.max_wait_s
            if now < deadline:
                return Batch(drop=drop, wait_until=deadline)
        drop += self._yield_lookahead(now)
        add, waited = self._admit(now)
        return Batch(drop=drop, add=add, waited_s=waited, step=self._stepping(now))

    def _yield_lookahead(self, now: float) -> tuple[int, ...]:
        """Look-ahead rows that give their batch places to the heard segments waiting for one.

        Only rows of streams ``lookahead_lead_s`` ahead of real time yield (their listeners have
        that much audio in hand; a stream with less needs its look-ahead soon), the least work
        lost first: the least audio made, then the latest admitted. A yielded row is dropped
        from the engine, KV slot and all, and its segment queued again: a batch place *is* a KV
        slot here (the ChatTTS engine holds ``--max-batch`` slots and refuses an add beyond
        them), so only freeing the slot lets the newcomer in, and a pool with slots beyond the
        batch would be memory taken from batch places. Redoing the segment costs its share of
        one prefill and the tokens it had made, none of them heard; its seed offset is the same,
        so a seeded stream gets the same audio. The rule acts only on a full batch: on the CPU
        (``--max-batch`` 16, at most 1 + look-ahead rows a stream) a closed loop of up to eight
        streams never fills it.
        """
        need = self._waiting.count(0) - max(0, self.batch_limit - len(self._running))
        if need <= 0:
            return ()
        lead = self.config.lookahead_lead_s
        rows = [s for s, plan in self._running.items() if plan.is_lookahead(s) and plan.lead_s(now) >= lead]
        rows.sort(key=lambda s: (self._running[s].held_samples(s), -s))
        chosen = rows[:need]
        if len(self._running) - len(chosen) >= self.batch_limit:
            return ()  # above a limit an out-of-memory lowered: yielding would free no place
        for seq_id in chosen:
            plan = self._running.pop(seq_id)
            self._waiting.push(1, Waiting(plan, plan.give_up(seq_id), now))
        return tuple(chosen)

    def _stepping(self, now: float) -> tuple[int, ...]:
        """The running sequences the step advances: look-ahead only where its stream has a lead.

        A gated look-ahead steps anyway while a heard segment waits for a slot (it must finish to
        free one); gated before it first steps, it is not prefilled and holds no KV slot. A stream's
        heard segment is always running or waiting, so a gate never leaves the batch with nothing.
        """
        lead = self.config.lookahead_lead_s
        ungated = lead <= 0 or bool(self._waiting.by_client(0))
        ready = [
            seq_id
            for seq_id, plan in self._running.items()
            if ungated or plan.live_seqs[seq_id] == plan.emit_index or plan.lead_s(now) >= lead
        ]
        return tuple(itertools.islice(ready, self.batch_limit))

    def refuse(self, seq_id: int) -> list[StreamEvent]:
        """The engine would not take this sequence (``engine.add`` raised): its stream fails."""
        plan = self._running.pop(seq_id, None)
        if plan is None:
            return []
        plan.live_seqs.pop(seq_id, None)  # never in the engine: nothing to drop
        return self._end(plan, "error", REFUSED_MESSAGE)

    def update(self, batch: Batch, outcome: Outcome, now: float) -> list[CoreEvent]:
        """What the step (or probe) of ``batch`` did; returns the events it releases."""
        match outcome:
            case Probed(ok=ok):
                return self._probed(ok, now)
            case OutOfMemory() if len(batch.step) > 1:
                # Retry at once with the first half; the rest stay paused in the engine.
                self._health.out_of_memory(len(batch.step))
                return []
            case OutOfMemory() | StepFailed():  # out of memory with a batch of one: a failure
                return self._failed(batch.step, now)
            case Stepped():
                return self._stepped(outcome, now)
            case _:
                assert_never(outcome)

    def _stepped(self, outcome: Stepped, now: float) -> list[CoreEvent]:
        self._health.stepped()
        self.seconds_per_block = 0.8 * self.seconds_per_block + 0.2 * outcome.elapsed_s
        events: list[CoreEvent] = []
        for result in outcome.results:
            events += self._route(result, now)
        return events

    def open_breaker(self, now: float) -> list[CoreEvent]:
        """Stop taking work: waiting streams fail now, new ones are refused, probes begin."""
        self._health.open(now)
        events: list[CoreEvent] = [BreakerChanged(open=True)]
        waiting = dict.fromkeys(entry.plan for entry in self._waiting)
        for plan in waiting:
            if not plan.ended:
                events += self._end(plan, "error", BREAKER_MESSAGE)
        return events

    # --- internals -------------------------------------------------------------------

    def _queue(self, plan: StreamPlan, now: float) -> list[StreamEvent]:
        """Queue the stream's next segments as its look-ahead allows; complete it when done."""
        for index in plan.segments_to_queue(self.config.lookahead):
            # Priority 0 for the segment a listener is waiting for, 1 for look-ahead.
            priority = 0 if index == plan.emit_index else 1
            self._waiting.push(priority, Waiting(plan, index, now))
        return self._end(plan, "complete") if plan.complete else []

    def _admit(self, now: float) -> tuple[tuple[SequenceRequest, ...], tuple[float, ...]]:
        added: list[SequenceRequest] = []
        waited: list[float] = []
        while self._waiting and len(self._running) < self.batch_limit:
            entry = self._waiting.pop()
            plan, seq_id = entry.plan, next(self._seq_ids)
            text = plan.segments[entry.segment]  # its tokens in proportion: no long babble for a short text
            added.append(
                SequenceRequest(
                    seq_id=seq_id,
                    text=text,
                    params=plan.params,
                    max_tokens=segment_token_cap(text, self.config.max_tokens_per_segment),
                    seed_offset=plan.first_segment + entry.segment,
                )
            )
            waited.append(now - entry.since)
            plan.live_seqs[seq_id] = entry.segment
            self._running[seq_id] = plan
        return tuple(added), tuple(waited)

    def _route(self, result: StepResult, now: float) -> list[StreamEvent]:
        plan = self._running.get(result.seq_id)
        if plan is None:
            return []
        segment = plan.live_seqs[result.seq_id]
        if result.finished:  # the engine has released it already
            del self._running[result.seq_id]
            del plan.live_seqs[result.seq_id]
        events = plan.on_audio(segment, result.audio, result.finished)
        plan.count_heard(events, now)
        if result.finished:
            if plan.emit_index != segment and plan.emit_index not in plan.live_seqs.values():
                # The listener now waits for a segment queued as look-ahead: it ranks as heard.
                self._waiting.promote(plan, plan.emit_index)
            events += self._queue(plan, now)
        return events

    def _failed(self, step: Sequence[int], now: float) -> list[CoreEvent]:
        events: list[CoreEvent] = []
        # The breaker opens first, so that whoever hears of these failures sees it open.
        if self._health.failed():
            events += self.open_breaker(now)
        for seq_id in step:
            plan = self._running.get(seq_id)
            if plan is not None:
                events += self._end(plan, "error", FAILED_MESSAGE)
        return events

    def _probed(self, ok: bool, now: float) -> list[CoreEvent]:
        return [BreakerChanged(open=False)] if self._health.probed(ok, now) else []

    def _end(self, plan: StreamPlan, reason: EndReason, message: str = "") -> list[StreamEvent]:
        """End a stream: its engine sequences are dropped by the next batch, its queue entries go."""
        plan.ended = True
        for seq_id in plan.live_seqs:
            if self._running.pop(seq_id, None) is not None:
                self._drops.append(seq_id)
        plan.live_seqs.clear()
        plan.held.clear()
        self._plans.pop(plan.stream_id, None)
        self._waiting.remove(plan)
        return [Ended(plan.stream_id, reason, message)]
