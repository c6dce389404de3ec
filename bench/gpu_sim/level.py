"""One simulated level of ``python -m bench.gpu_sim``: the real engine core on a virtual clock.

:func:`run_level` builds the server's own :class:`~server.core.engine_core.EngineCore` (and
so its :class:`~server.core.policy.SchedulingPolicy`) over a
:class:`~bench.gpu_sim.engine.QuantumEngine`, reading a :class:`~bench.gpu_sim.clock.VirtualClock`,
and drives it round by round as its thread would: the streams' ``Add`` commands arrive at
their virtual times through the engine client's admission rule, each round runs the core's
own ``_iterate`` (take commands, schedule, add, step, update, publish), and an idle round
waits in virtual time for the next command. Its events cross to a real asyncio loop with
``call_soon_threadsafe``, as the engine client's hand-off does, and every stream's audio is
played out to a listener on the virtual clock (``bench.harness.listener``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.gpu_sim.clock import VirtualClock
from bench.gpu_sim.engine import QuantumEngine
from bench.gpu_sim.model import CostModel
from bench.gpu_sim.tokens import BLOCK_SCHEDULE, TOKENS_PER_S, segment_tokens
from bench.harness.listener import simulate
from bench.harness.stats import distribution
from bench.harness.textset import BenchText
from server.core.admission import refusal
from server.core.engine_core import EngineCore
from server.core.events import Add, Admission, Audio, Capacity, CoreEvent, Ended
from server.core.policy import INITIAL_SECONDS_PER_BLOCK, PolicyConfig
from server.engine_api import NATIVE_SAMPLE_RATE, SynthesisParams
from server.metrics import Metrics
from server.text.segments import split_segments

#: Listener buffers (ms) whose underruns are counted; the level rule reads the first.
LISTENER_MS = (300, 100)
#: The level rule (issue #43): no underrun at 300 ms, first audio p99 at most this, no refusal.
TTFA_P99_LIMIT_S = 0.150
#: A level that has not drained this long after its last arrival is cut (its streams count as failed).
DRAIN_LIMIT_S = 120.0


@dataclass(frozen=True)
class StreamSpec:
    """One listener's request: when it comes and what it says."""

    stream_id: int
    arrive_s: float
    segments: tuple[str, ...]
    seed: int


@dataclass
class StreamLog:
    """What one stream saw on the virtual clock."""

    spec: StreamSpec
    refused: bool = False
    audio: list[tuple[float, float]] = field(default_factory=list)  # (virtual time, seconds)
    ended_s: float | None = None
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class SimSettings:
    """Everything a level runs with besides its size and arrivals."""

    model: CostModel
    policy: PolicyConfig
    quantum: int = 4
    overlap: bool = True
    host_scale: float = 1.0
    slots: int = 392
    duration_s: float = 40.0
    seed: int = 43
    schedule: tuple[int, ...] = BLOCK_SCHEDULE


def segments_of(text: str, max_chars: int = 120) -> tuple[str, ...]:
    """The server's own split of a text into model segments."""
    return tuple(split_segments(text, max_chars=max_chars))


def mean_stream_s(texts: Sequence[BenchText]) -> float:
    """Mean audio seconds of a stream over the text set (the length model's jitter averages to 1)."""
    total = 0.0
    for text in texts:
        for offset, segment in enumerate(segments_of(text.text)):
            tokens, _ = segment_tokens(segment, None, offset)
            total += tokens / TOKENS_PER_S
    return total / len(texts)


def make_streams(
    n: int, arrival: str, texts: Sequence[BenchText], *, duration_s: float, seed: int
) -> list[StreamSpec]:
    """``burst``: ``n`` streams at time 0; ``poisson``: arrivals at ``n`` listeners' rate for ``duration_s``.

    A Poisson level holds ``n`` listeners on average (Little's law over the streams' audio
    length), the way ``n`` people listening at once do.
    """
    rng = np.random.default_rng([seed, n, 0 if arrival == "burst" else 1])
    if arrival == "burst":
        times = [0.0] * n
    elif arrival == "poisson":
        rate = n / mean_stream_s(texts)
        gaps = rng.exponential(1.0 / rate, size=int(rate * duration_s * 1.5) + 16)
        arrivals = np.cumsum(gaps)
        times = [float(t) for t in arrivals[arrivals < duration_s]]
    else:
        raise ValueError(f"unknown arrival {arrival!r} (burst, poisson)")
    order = rng.permutation(len(texts))
    return [
        StreamSpec(k, t, segments_of(texts[order[k % len(texts)]].text), seed * 100_000 + k)
        for k, t in enumerate(times)
    ]


class _Hand:
    """The engine client's side, as far as the simulation needs it: admission and the hand-off."""

    def __init__(self, clock: VirtualClock, config: PolicyConfig, logs: dict[int, StreamLog]) -> None:
        self.clock = clock
        self.config = config
        self.logs = logs
        self.capacity = Capacity(Admission(0, config.max_batch, INITIAL_SECONDS_PER_BLOCK, False), 0)
        self.adds_sent = 0
        self.open = 0
        self.loop = asyncio.new_event_loop()
        self._handed = 0

    def emit(self, events: list[CoreEvent]) -> None:
        """The core's sink: one ``call_soon_threadsafe`` per batch (charged: it is the server's)."""
        with self.clock.uncharged():
            stamp = self.clock.now()
        self.loop.call_soon_threadsafe(self._dispatch, stamp, events)
        with self.clock.uncharged():
            self._handed += 1
            if self._handed >= 64:  # the event loop's side runs on its own thread: not charged
                self.drain()

    def drain(self) -> None:
        """Run the hand-offs queued on the event loop."""
        self.loop.run_until_complete(asyncio.sleep(0))
        self._handed = 0

    def _dispatch(self, stamp: float, events: list[CoreEvent]) -> None:
        for event in events:
            if isinstance(event, Audio):
                if len(event.samples):
                    self.logs[event.stream_id].audio.append((stamp, len(event.samples) / NATIVE_SAMPLE_RATE))
            elif isinstance(event, Ended):
                log = self.logs[event.stream_id]
                log.ended_s, log.reason = stamp, event.reason
                self.open -= 1
            elif isinstance(event, Capacity):
                self.capacity = event

    def submit(self, core: EngineCore, spec: StreamSpec) -> None:
        """A listener's request through the engine client's admission rule (the event loop's: not charged)."""
        log = self.logs[spec.stream_id]
        pending = self.adds_sent - self.capacity.adds_taken
        if refusal(self.capacity.admission, self.config, pending) is not None:
            log.refused, log.reason = True, "overloaded"
            return
        self.adds_sent += 1
        self.open += 1
        params = SynthesisParams(seed=spec.seed)
        core.send(Add(spec.stream_id, spec.segments, params))


def run_level(n: int, arrival: str, texts: Sequence[BenchText], settings: SimSettings) -> dict[str, Any]:
    """Simulate one level; returns its figures (see :func:`summarize`)."""
    specs = make_streams(n, arrival, texts, duration_s=settings.duration_s, seed=settings.seed)
    clock = VirtualClock(settings.host_scale)
    engine = QuantumEngine(
        clock,
        settings.model,
        quantum=settings.quantum,
        overlap=settings.overlap,
        slots=settings.slots,
        schedule=settings.schedule,
    )
    logs = {spec.stream_id: StreamLog(spec) for spec in specs}
    hand = _Hand(clock, settings.policy, logs)
    core = EngineCore(
        lambda: engine, settings.policy, emit=hand.emit, metrics=Metrics(), warmup=False, clock=clock.now
    )
    # What ``run`` does once the engine is loaded. The engine has no ``interrupt``, so no
    # waiting command cuts a quantum short.
    core.engine = engine
    cpu0 = time.process_time()
    limit = (specs[-1].arrive_s if specs else 0.0) + DRAIN_LIMIT_S
    index = 0

    def arrive() -> None:
        """Requests that came by now reach the core's intake (also while a quantum runs)."""
        nonlocal index
        with clock.uncharged():
            now = clock.now()
            while index < len(specs) and specs[index].arrive_s <= now:
                hand.submit(core, specs[index])
                index += 1

    engine.on_wait = arrive
    cut = False
    while True:
        arrive()
        with clock.uncharged():
            hand.drain()
            if index == len(specs) and hand.open == 0:
                break
            if clock.now() > limit:
                cut = True
                break
        # One round of the inference thread's loop, exactly as ``EngineCore.run`` calls it; a
        # real wait for a command is replaced by a virtual one below.
        wait = core._iterate(engine, 0.0)
        if wait is None:
            break
        if wait > 0:
            with clock.uncharged():
                upcoming = specs[index].arrive_s if index < len(specs) else float("inf")
                clock.wait_until(min(clock.now() + wait, upcoming))
    hand.loop.close()
    span = max(clock.now(), engine.log.busy_until_s)
    return summarize(n, arrival, list(logs.values()), engine, clock, span, settings, cut=cut) | {
        "sim_cpu_s": round(time.process_time() - cpu0, 2)
    }


def summarize(
    n: int,
    arrival: str,
    logs: list[StreamLog],
    engine: QuantumEngine,
    clock: VirtualClock,
    span: float,
    settings: SimSettings,
    *,
    cut: bool,
) -> dict[str, Any]:
    """A level's figures; a Poisson level's listener figures count the streams that came after the ramp."""
    # A Poisson level ramps up over about one stream's length (a short run: a third of it).
    warm = min(mean_stream_s_of(logs), settings.duration_s / 3) if arrival == "poisson" else 0.0
    counted = [log for log in logs if log.spec.arrive_s >= warm]
    ttfa = [log.audio[0][0] - log.spec.arrive_s for log in counted if log.audio]
    listeners: dict[str, Any] = {}
    for ms in LISTENER_MS:
        runs = [
            simulate(
                [(t - log.spec.arrive_s, s) for t, s in log.audio]
                + [((log.ended_s or span) - log.spec.arrive_s, 0.0)],
                ms / 1000.0,
            )
            for log in counted
            if log.audio
        ]
        listeners[str(ms)] = {
            "streams_with_underruns": sum(1 for r in runs if r.underruns),
            "underruns": sum(r.underruns for r in runs),
            "stall_s": distribution(r.stall_s for r in runs),
        }
    device = engine.log
    quanta = max(device.quanta, 1)
    failed = [log for log in logs if log.refused or log.reason not in ("complete",)]
    ttfa_d = distribution(ttfa)
    audio_s = sum(s for log in logs for _, s in log.audio)
    passed = (
        not failed
        and not cut
        and listeners["300"]["streams_with_underruns"] == 0
        and ttfa_d["p99"] is not None
        and ttfa_d["p99"] <= TTFA_P99_LIMIT_S
    )
    return {
        "streams": n,
        "arrival": arrival,
        "requests": len(logs),
        "counted": len(counted),
        "counted_from_s": round(warm, 2),
        "refused": sum(1 for log in logs if log.refused),
        "failed": len(failed),
        "cut": cut,
        "ttfa_ms": {k: (None if v is None else round(v * 1000, 1)) for k, v in ttfa_d.items() if k != "n"},
        "listeners": listeners,
        "virtual_s": round(span, 3),
        "audio_s_per_s": round(audio_s / max(span, 1e-9), 2),
        "quanta": device.quanta,
        "quanta_per_s": round(device.quanta / max(span, 1e-9), 2),
        "rows_per_quantum": round(device.rows / quanta, 2),
        "frozen_rows_per_quantum": round(device.frozen_rows / quanta, 2),
        "tokens_per_row_quantum": round(device.tokens / max(device.rows - device.frozen_rows, 1), 3),
        "short_rows": device.short_rows,
        "yielded_rows": device.yielded_rows,
        "yielded_token_share": round(device.yielded_tokens / max(device.tokens, 1), 4),
        "host_reads_per_quantum": round(device.host_reads / quanta, 3),
        "device_ms_per_quantum": {
            "step": round(device.step_s / quanta * 1000, 3),
            "decode": round(device.decode_s / quanta * 1000, 3),
            "prefill": round(device.prefill_s / quanta * 1000, 3),
        },
        "host_ms_per_quantum": round(clock.host_s / quanta * 1000, 3),
        # A quantum's wall time over the audio it makes a row: below 1, rows run faster than real time.
        "row_rtf": round(span / quanta / (settings.quantum / TOKENS_PER_S), 3),
        "device_busy": round(device.busy_s / max(span, 1e-9), 3),
        "host_busy": round(clock.host_s / max(span, 1e-9), 3),
        "host_s": round(clock.host_s, 3),
        "peak_slots": device.peak_slots,
        "prefills": device.prefills,
        "rows_per_prefill": round(device.prefilled_rows / max(device.prefills, 1), 2),
        "rows_per_decode": round(device.decoded_rows / max(device.decodes, 1), 2),
        "passed": passed,
    }


def mean_stream_s_of(logs: list[StreamLog]) -> float:
    """Mean audio length of the level's streams (a Poisson level's ramp)."""
    lengths = [
        sum(segment_tokens(seg, log.spec.seed, i)[0] for i, seg in enumerate(log.spec.segments))
        / TOKENS_PER_S
        for log in logs
    ]
    return float(np.mean(lengths)) if lengths else 0.0


def dump(results: dict[str, Any]) -> str:
    """The JSON file's text."""
    return json.dumps(results, indent=1, sort_keys=False) + "\n"
