"""A deterministic engine for tests, demos and load tests (no model, no torch).

Audio is a function of the request alone (:func:`expected_audio`), so a test
can recompute every sample the server should send. Each step costs
``a + b·batch`` seconds of wall time (``time.sleep`` on the inference
thread, which releases the GIL like a real model step would), plus ``h``
seconds of Python work that holds the GIL (``step_host_s``: a model's host
side, launching graphs and reading results); failures can be injected
programmatically or by a marker in the text.

The host work's pace is measured (:meth:`FakeEngine.host_time`): what a step took beyond
its sleep, its CPU time and its wait for a free core (Linux's per-thread run-queue wait,
``/proc/thread-self/schedstat``) is time the thread was held off a core it could have
run on: the GIL, held by another thread of this process. A loaded machine slows the
step but does not show up there, so a test can tell the two apart.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from server.engine_api import (
    AudioArray,
    Codes,
    EngineError,
    EngineInfo,
    EngineOutOfMemory,
    SequenceRequest,
    StepResult,
    SynthesisParams,
)

SAMPLES_PER_TOKEN = 512
#: A sequence whose text contains this marker makes every step it is in fail (no square
#: brackets: those are reserved for control tags and refused before any engine sees them).
FAIL_MARKER = "{{fail}}"
FAKE_VOICES = ("default", "alto", "tenor")
#: What the fake engine says makes its voices' codes (a real engine names its weights).
FAKE_VOICE_ENCODER = "fake-encoder-1"
SCHEDSTAT = "/proc/thread-self/schedstat"
PR_SET_TIMERSLACK = 29
#: A step's quanta when it has host work: 16-token blocks of 4-token quanta, as on CUDA.
QUANTA_PER_STEP = 4


def thread_times() -> tuple[float, float]:
    """This thread's CPU time and its time waiting for a core (run queue), in seconds.

    Where the kernel has no per-thread scheduler statistics: the CPU time alone (no wait seen).
    """
    try:
        with open(SCHEDSTAT, "rb") as stat:
            on_cpu, queued, _slices = stat.read().split()
        return int(on_cpu) / 1e9, int(queued) / 1e9
    except (OSError, ValueError):
        return time.thread_time(), 0.0


def exact_sleeps() -> None:
    """This thread's sleeps end on time (Linux: a 1 ns timer slack instead of 50 µs).

    A sleep's slack is time the thread is held off a core that the pace measure would
    otherwise count; where the call is not available, it stays in the measure.
    """
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)


def python_work(seconds: float) -> None:
    """Hold the GIL doing Python work until this thread has spent ``seconds`` of CPU."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        sum(range(200))


def token_count(text: str, tokens_per_char: float, max_tokens: int) -> int:
    """How many audio tokens the fake engine generates for ``text``."""
    return max(1, min(max_tokens, math.ceil(len(text.strip()) * tokens_per_char)))


def _sequence_rng(request: SequenceRequest) -> np.random.Generator:
    params = request.params
    if params.seed is None:
        return np.random.default_rng()
    key = "\x1f".join(
        str(part)
        for part in (
            request.text,
            params.voice,
            params.speed,
            params.seed,
            request.seed_offset,
            params.temperature,
            params.top_p,
            params.top_k,
            # Refinement and a recording's voice change the audio, as they do in a real engine.
            params.refine,
            params.refine_prompt,
            params.reference.digest if params.reference is not None else "",
        )
    )
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def expected_audio(request: SequenceRequest, *, tokens_per_char: float = 2.0) -> AudioArray:
    """The exact float32 samples the fake engine produces for ``request``.

    Each token is a 512-sample tone whose pitch is drawn from the request's
    generator; the phase runs on across tokens so the signal has no clicks
    (useful for codec tests). Only defined sample for sample when the
    request has a seed.
    """
    rng = _sequence_rng(request)
    n_tokens = token_count(request.text, tokens_per_char, request.max_tokens)
    freqs = rng.uniform(150.0, 600.0, size=n_tokens) * request.params.speed
    per_sample = np.repeat(freqs, SAMPLES_PER_TOKEN) / 24_000.0
    phase = 2.0 * np.pi * np.cumsum(per_sample)
    return (0.25 * np.sin(phase)).astype(np.float32)


@dataclass
class _Sequence:
    request: SequenceRequest
    audio: AudioArray
    tokens_total: int
    tokens_done: int = 0
    steps: int = 0


@dataclass(frozen=True)
class StepRecord:
    """One engine step, for tests that assert batching from the step log."""

    index: int
    seq_ids: tuple[int, ...]
    failed: bool = False


@dataclass
class FailurePlan:
    """Programmatic failure injection (set from tests, read by the engine thread)."""

    fail_steps: int = 0
    oom_steps: int = 0
    oom_above_batch: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class FakeEngine:
    """Deterministic engine: known audio per token, a cost model, failure injection."""

    def __init__(
        self,
        *,
        step_base_s: float = 0.002,
        step_per_row_s: float = 0.0005,
        step_host_s: float = 0.0,
        first_block_tokens: int = 4,
        block_tokens: int = 16,
        tokens_per_char: float = 2.0,
        log_limit: int = 100_000,
        refine: bool = True,
        voices: bool = True,
        max_text_tokens: int | None = None,
    ) -> None:
        self.step_base_s = step_base_s
        self.step_per_row_s = step_per_row_s
        self.step_host_s = step_host_s
        self._host_cpu_s = 0.0  # CPU time of the steps' host work and sleeps
        self._host_held_s = 0.0  # of the steps' wall time: neither sleeping, on a core, nor waiting for one
        self._exact_sleeps = False
        self.first_block_tokens = first_block_tokens
        self.block_tokens = block_tokens
        self.tokens_per_char = tokens_per_char
        self.failures = FailurePlan()
        #: Every step and every add/drop, bounded; tests read it.
        self.steps: deque[StepRecord] = deque(maxlen=log_limit)
        self.events: deque[tuple[str, int]] = deque(maxlen=log_limit)
        #: Every sequence added, as asked (its ``max_tokens`` is the work it may cost), bounded.
        self.added: deque[SequenceRequest] = deque(maxlen=log_limit)
        self._sequences: dict[int, _Sequence] = {}
        self._step_index = 0
        self._info = EngineInfo(
            name="fake",
            voices=FAKE_VOICES,
            samples_per_token=SAMPLES_PER_TOKEN,
            refine=refine,
            voice_encoder=FAKE_VOICE_ENCODER if voices else None,
            max_text_tokens=max_text_tokens,
        )

    @property
    def info(self) -> EngineInfo:
        """Static facts about this engine."""
        return self._info

    @property
    def live_sequences(self) -> int:
        """Sequences currently holding state (tests assert that work is freed)."""
        return len(self._sequences)

    def validate_voice(self, voice: str) -> bool:
        """Named fake voices and ``seed:<int>`` are accepted."""
        if voice in FAKE_VOICES:
            return True
        prefix, _, number = voice.partition(":")
        return prefix == "seed" and number.lstrip("-").isdigit()

    def text_tokens(self, text: str) -> int:
        """One token a character of the stripped text (a real engine spells numbers out first)."""
        return len(text.strip())

    def encode_voice(self, audio: AudioArray, transcript: str) -> Codes:
        """Fake codes: 4 rows of one code per 512 samples, a function of the audio (ChatTTS: ~47 a second)."""
        if not transcript.strip():
            raise ValueError("the transcript has nothing to speak")
        frames = max(1, len(audio) // SAMPLES_PER_TOKEN)
        padded = np.resize(np.abs(audio), frames * SAMPLES_PER_TOKEN)
        levels = padded.reshape(frames, -1).mean(axis=1)
        codes = (levels * 4096).astype(np.uint16) % 626
        return np.stack([codes + k for k in range(4)]).astype(np.uint16)

    def add(self, request: SequenceRequest) -> None:
        """Register a sequence; its audio is computed now (cheap)."""
        audio = expected_audio(request, tokens_per_char=self.tokens_per_char)
        total = len(audio) // SAMPLES_PER_TOKEN
        self._sequences[request.seq_id] = _Sequence(request, audio, total)
        self.events.append(("add", request.seq_id))
        self.added.append(request)

    def drop(self, seq_id: int) -> None:
        """Forget a sequence."""
        if self._sequences.pop(seq_id, None) is not None:
            self.events.append(("drop", seq_id))

    def step(self, seq_ids: list[int]) -> list[StepResult]:
        """Advance each sequence by one block, sleeping per the cost model."""
        index = self._step_index
        self._step_index += 1
        self._timed_work(self.step_base_s + self.step_per_row_s * len(seq_ids))
        try:
            self._maybe_fail(seq_ids)
        except EngineError:
            self.steps.append(StepRecord(index, tuple(seq_ids), failed=True))
            raise
        self.steps.append(StepRecord(index, tuple(seq_ids)))
        return [self._advance(self._sequences[seq_id]) for seq_id in seq_ids]

    def _timed_work(self, sleep_s: float) -> None:
        """The step's cost: ``sleep_s`` of device time and the host work; its pace measured.

        With host work the step runs as a GPU engine's does: :data:`QUANTA_PER_STEP` quanta,
        each launched by the host (Python, holding the GIL) and then waited for (a sleep, the
        GIL released), so the host takes the GIL back once a quantum.
        """
        if self.step_host_s > 0 and not self._exact_sleeps:
            exact_sleeps()  # the inference thread's, on its first step
            self._exact_sleeps = True
        started, (cpu, queued) = time.perf_counter(), thread_times()
        if self.step_host_s > 0:
            for _ in range(QUANTA_PER_STEP):
                python_work(self.step_host_s / QUANTA_PER_STEP)
                time.sleep(sleep_s / QUANTA_PER_STEP)
        else:
            time.sleep(sleep_s)
        wall = time.perf_counter() - started
        cpu_after, queued_after = thread_times()
        cpu_s, queued_s = cpu_after - cpu, queued_after - queued
        self._host_cpu_s += cpu_s
        # A sleep overshoots by the timer's slack (tens of µs) besides the GIL: both count.
        self._host_held_s += max(0.0, wall - sleep_s - cpu_s - queued_s)

    def host_time(self) -> tuple[float, float]:
        """Seconds of the steps' host work on a core, and seconds it was held off one (the GIL)."""
        return self._host_cpu_s, self._host_held_s

    def _maybe_fail(self, seq_ids: list[int]) -> None:
        plan = self.failures
        with plan.lock:
            if plan.oom_steps > 0:
                plan.oom_steps -= 1
                raise EngineOutOfMemory("injected out-of-memory")
            if plan.oom_above_batch is not None and len(seq_ids) > plan.oom_above_batch:
                raise EngineOutOfMemory(f"injected out-of-memory above batch {plan.oom_above_batch}")
            if plan.fail_steps > 0:
                plan.fail_steps -= 1
                raise EngineError("injected failure")
        if any(FAIL_MARKER in self._sequences[s].request.text for s in seq_ids):
            raise EngineError("injected failure (text marker)")

    def _advance(self, seq: _Sequence) -> StepResult:
        block = self.first_block_tokens if seq.steps == 0 else self.block_tokens
        start = seq.tokens_done
        end = min(seq.tokens_total, start + block)
        seq.tokens_done = end
        seq.steps += 1
        finished = end >= seq.tokens_total
        audio = seq.audio[start * SAMPLES_PER_TOKEN : end * SAMPLES_PER_TOKEN]
        seq_id = seq.request.seq_id
        if finished:
            del self._sequences[seq_id]
            self.events.append(("finish", seq_id))
        return StepResult(seq_id=seq_id, audio=audio, tokens=end - start, finished=finished)

    def warmup(self) -> None:
        """Run one tiny sequence through a step (exercises the same code path)."""
        request = SequenceRequest(seq_id=-1, text="warm up", params=SynthesisParams(seed=0))
        self.add(request)
        while self._sequences.get(-1) is not None:
            self.step([-1])
        self.steps.clear()
        self.events.clear()
        self.added.clear()
        self._step_index = 0

    def close(self) -> None:
        """Nothing to release."""
        self._sequences.clear()
