"""The simulated GPU of ``python -m bench.gpu_sim``: an H100 cost model, a virtual clock, a quantum engine.

Only the device is modelled. :class:`VirtualClock` is the inference thread's time: every
second of CPU the thread really spends (``time.thread_time``: the policy, the engine core,
the hand-off, this engine's own Python around each launch) moves it on, and so does every
wait for the modelled device. :class:`QuantumEngine` implements the engine interface
(``server.engine_api.Engine``) the way issue #43 designs the CUDA engine: every row advances
a fixed ``K`` tokens per quantum (nothing cuts one short: it has no ``interrupt``), the
newcomers of one boundary are prefilled in one call, the rows due for audio are decoded in
one captured call, the host reads once per quantum, and with ``overlap`` quantum n+1 is
launched before quantum n is read (a row that ended runs one frozen quantum).

Every device constant is named in :class:`CostModel` with where it comes from.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from server.engine_api import (
    NATIVE_SAMPLE_RATE,
    AudioArray,
    Codes,
    EngineInfo,
    EngineOutOfMemory,
    SequenceRequest,
    StepResult,
)

#: One audio token is 512 samples at 24 kHz (21.3 ms; /work/shared/design/CHATTTS-FACTS.md).
SAMPLES_PER_TOKEN = 512
TOKENS_PER_S = NATIVE_SAMPLE_RATE / SAMPLES_PER_TOKEN  # 46.875
#: The served default block schedule (``--block-schedule``): a row decodes at its cumulative
#: targets 8, 24, 44, 64, 88, 112, 140, 172, 204, ... (every one a multiple of 4).
BLOCK_SCHEDULE = (8, 16, 20, 20, 24, 24, 28, 32)
#: Speech rate of the model's voices, for a segment's length in tokens: Chinese characters and
#: Latin characters (spaces included) spoken per second (typical read speech).
ZH_CHARS_PER_S = 4.5
EN_CHARS_PER_S = 14.0
#: A segment's prompt: the control tokens around the text ([Stts][spk_emb][speed_5]...[Ptts] and
#: the padding to its bucket), plus one token per CJK character or one per four Latin ones.
PROMPT_BASE_TOKENS = 16
EN_CHARS_PER_PROMPT_TOKEN = 4


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Device time of one H100 (and the host costs that live in the CUDA driver), in seconds.

    Sources (bench/results/gpu/*h200.md, one H200, bf16, the full-size dev model):

    - ``step_base_s`` 2.3 ms: the captured token step at batch 1 took 2.26 ms (2.31 in the
      first check); the step of a 190 M model is launch- and latency-bound, not bandwidth-bound
      (its weights take 0.11 ms to read at an H100's 3.35 TB/s), so an H100 is taken as equal.
    - ``step_row_s`` 4 µs and ``step_position_s`` 26 ns: the H200 step grew 1.02 ms from 1 to
      128 rows at 256 attended positions (8.0 µs a row); an H100 has 0.70× the H200's memory
      bandwidth, and attention reads every attended position's keys and values (60 KiB a
      position for 20 layers, 768 wide, bf16), so 4 µs + 256 × 26 ns = 10.7 µs a row (1.33× the
      H200's). Each row is charged for its own attended positions (split-K attention that reads a
      row only as far as it reaches: issue #43, item 6); padding rows of a graph bucket, 4 µs.
    - ``decode_base_s`` 1 ms and ``decode_row_s`` 0.1 ms: Decoder + Vocos eagerly took 7.6 ms a
      call at 1 row and 13.5 ms at 64 (0.38 and 0.67 ms per token step of a 20-token block):
      0.094 ms a row; captured as a graph, the 250–300 launches of the base (about 3 µs each
      replayed) leave about 1 ms.
    - ``prefill_base_s`` 2.5 ms and ``prefill_token_s`` 1.3 µs: a captured, batched prefill is a
      token step's launch cost plus the prompt tokens' compute (0.38 GFLOP a token at a few
      hundred TFLOP/s); eager it took 20–37 ms a sequence, launch-bound.
    - ``launch_s`` 10 µs: host time of one graph launch or async copy in the CUDA driver
      (``cudaLaunchKernel`` averaged 10 µs on the H200's host); ``read_s`` 50 µs: one host read
      of a quantum's summary and audio from pinned memory after its event (``cudaMemcpyAsync``
      averaged 47 µs). These run in the driver, which this machine has not, so they are charged
      as constants; all other host work is measured.
    - ``row_bucket`` 8: graphs are captured for batch sizes in steps of 8.
    - ``kv_position_bytes`` 60 KiB and ``kv_budget_bytes`` 70 GiB: the H200's 22.85 GiB held 128
      slots × 3120 positions; an 80 GB H100 keeps about 8 GiB for the weights, Decoder + Vocos,
      the graphs and their workspaces.
    """

    step_base_s: float = 2.3e-3
    step_row_s: float = 4e-6
    step_position_s: float = 26e-9
    decode_base_s: float = 1e-3
    decode_row_s: float = 0.1e-3
    prefill_base_s: float = 2.5e-3
    prefill_token_s: float = 1.3e-6
    launch_s: float = 10e-6
    read_s: float = 50e-6
    row_bucket: int = 8
    kv_position_bytes: int = 61_440
    kv_budget_bytes: int = 70 * 2**30

    def step_s(self, positions: list[int]) -> float:
        """One token step over rows attending ``positions`` each, padded to the graph bucket."""
        rows = len(positions)
        padded = -(-rows // self.row_bucket) * self.row_bucket
        return self.step_base_s + padded * self.step_row_s + sum(positions) * self.step_position_s

    def decode_s(self, rows: int) -> float:
        """One captured Decoder + Vocos call over ``rows`` due windows (0: none runs)."""
        return self.decode_base_s + rows * self.decode_row_s if rows else 0.0

    def prefill_s(self, prompts: list[int]) -> float:
        """One batched prefill of the newcomers' prompts (none: nothing runs)."""
        return self.prefill_base_s + sum(prompts) * self.prefill_token_s if prompts else 0.0

    def kv_slots(self, positions_per_slot: int) -> int:
        """KV slots of ``positions_per_slot`` positions that fit the card's KV budget."""
        return self.kv_budget_bytes // (positions_per_slot * self.kv_position_bytes)


class VirtualClock:
    """The inference thread's virtual time: its real CPU time, plus modelled waits.

    ``now()`` first adds the CPU time the calling thread spent since the last reading
    (``time.thread_time``, so other processes on a shared machine do not inflate it), times
    ``host_scale``, unless inside :meth:`uncharged` (the simulation's own work, which stands for
    the device or the outside world). The clock is read from one thread only.
    """

    def __init__(self, host_scale: float = 1.0) -> None:
        self.host_scale = host_scale
        self._t = 0.0
        self._mark = time.thread_time()
        self._paused = 0
        #: Host seconds charged: measured CPU time times ``host_scale``, plus :meth:`charge`.
        self.host_s = 0.0
        #: Seconds spent waiting: for the device, or idle for a command.
        self.wait_s = 0.0

    def _sync(self) -> None:
        cpu = time.thread_time()
        if not self._paused:
            spent = (cpu - self._mark) * self.host_scale
            self._t += spent
            self.host_s += spent
        self._mark = cpu

    def now(self) -> float:
        """Virtual seconds since the clock was made."""
        self._sync()
        return self._t

    def charge(self, seconds: float) -> None:
        """Host work that runs in code this machine has not (the CUDA driver)."""
        self._sync()
        self._t += seconds
        self.host_s += seconds

    def wait_until(self, t: float) -> None:
        """Block (no CPU) until virtual time ``t``; no-op when it has passed."""
        self._sync()
        if t > self._t:
            self.wait_s += t - self._t
            self._t = t

    @contextmanager
    def uncharged(self) -> Iterator[None]:
        """CPU spent inside is the simulation's own, not the server's: it moves no time."""
        self._sync()
        self._paused += 1
        try:
            yield
        finally:
            self._sync()
            self._paused -= 1


def segment_tokens(text: str, seed: int | None, offset: int) -> tuple[int, int]:
    """``(audio tokens, prompt tokens)`` of a segment: its speech at the voices' rate, ±20 %.

    Deterministic in the text, the stream's seed and the segment's offset, as a seeded
    model's length is.
    """
    cjk = sum(1 for ch in text if "\u3000" <= ch <= "\u9fff" or "\uff00" <= ch <= "\uffef")
    latin = len(text) - cjk
    seconds = cjk / ZH_CHARS_PER_S + latin / EN_CHARS_PER_S
    digest = hashlib.sha256(f"{text}\x1f{seed}\x1f{offset}".encode()).digest()
    jitter = 0.8 + 0.4 * int.from_bytes(digest[:4], "little") / 2**32
    tokens = max(4, math.ceil(seconds * TOKENS_PER_S * jitter))
    prompt = PROMPT_BASE_TOKENS + cjk + -(-latin // EN_CHARS_PER_PROMPT_TOKEN)
    return tokens, prompt


def decode_targets(schedule: tuple[int, ...] = BLOCK_SCHEDULE) -> Iterator[int]:
    """A row's cumulative decode targets: 8, 24, 44, ... (the last block size repeats)."""
    total = 0
    index = 0
    while True:
        total += schedule[min(index, len(schedule) - 1)]
        index += 1
        yield total


@dataclass(eq=False)
class _Row:
    """One sequence's device state as the engine tracks it."""

    seq_id: int
    total: int  # audio tokens it will make (its EOS)
    prompt: int
    max_tokens: int
    done: int = 0  # tokens made on the device
    decoded: int = 0  # tokens whose audio was decoded
    prefilled: bool = False
    ended: bool = False  # the device has made its last token (the host learns at the read)
    released: bool = False  # the host reported it finished
    targets: Iterator[int] = field(default_factory=decode_targets)
    next_target: int = 0

    def __post_init__(self) -> None:
        self.total = min(self.total, self.max_tokens)
        self.next_target = next(self.targets)


@dataclass
class _Quantum:
    """One launched quantum: when the device finishes it and what its read will say."""

    end_s: float
    produced: list[tuple[_Row, int, int, bool]]  # row, tokens, decoded tokens, ended


@dataclass
class DeviceLog:
    """What the modelled device did (the report's figures)."""

    quanta: int = 0
    rows: int = 0  # row-quanta, frozen ones included
    frozen_rows: int = 0  # rows that had ended but ran a frozen quantum
    padded_rows: int = 0  # graph-bucket padding
    tokens: int = 0
    short_rows: int = 0  # live rows that made fewer than K tokens without ending (must stay 0)
    step_s: float = 0.0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    decodes: int = 0
    decoded_rows: int = 0
    prefills: int = 0
    prefilled_rows: int = 0
    host_reads: int = 0
    busy_until_s: float = 0.0
    peak_slots: int = 0
    yielded_rows: int = 0  # live rows dropped before their end: look-ahead that gave its place up
    yielded_tokens: int = 0  # the tokens those rows had made (made again later)

    @property
    def busy_s(self) -> float:
        """Device seconds of work."""
        return self.step_s + self.decode_s + self.prefill_s


class QuantumEngine:
    """The engine interface over the modelled device, in quanta of ``quantum`` tokens.

    Args:
        clock: the inference thread's clock (the core must read the same one).
        model: the device's costs.
        quantum: tokens every row advances per quantum (K).
        overlap: launch quantum n+1 before reading quantum n.
        slots: KV slots (rows prefilled at once); more raise ``EngineOutOfMemory``.
        schedule: the block schedule whose cumulative targets are a row's decodes (multiples of K).
    """

    def __init__(
        self,
        clock: VirtualClock,
        model: CostModel,
        *,
        quantum: int = 4,
        overlap: bool = True,
        slots: int,
        schedule: tuple[int, ...] = BLOCK_SCHEDULE,
    ) -> None:
        if any(size % quantum for size in schedule):
            raise ValueError(f"every block of {schedule} must be a multiple of the quantum {quantum}")
        self.schedule = schedule
        self.clock = clock
        self.model = model
        self.quantum = quantum
        self.overlap = overlap
        self.slots = slots
        self.log = DeviceLog()
        self._rows: dict[int, _Row] = {}
        self._inflight: _Quantum | None = None
        self._device_free = 0.0
        #: Called after every wait for the device: the simulation delivers the commands that came meanwhile.
        self.on_wait: Callable[[], None] = lambda: None
        self._info = EngineInfo(name="gpu-sim", samples_per_token=SAMPLES_PER_TOKEN)

    @property
    def info(self) -> EngineInfo:
        """Static facts about this engine."""
        return self._info

    def validate_voice(self, voice: str) -> bool:
        """Every voice is spoken (the simulation has no voices)."""
        return True

    def add(self, request: SequenceRequest) -> None:
        """Register a sequence; it is prefilled with the next quantum it takes part in."""
        seed = request.params.seed
        tokens, prompt = segment_tokens(request.text, seed, request.seed_offset)
        row = _Row(request.seq_id, tokens, prompt, request.max_tokens, targets=decode_targets(self.schedule))
        self._rows[request.seq_id] = row

    def drop(self, seq_id: int) -> None:
        """Forget a sequence (its slot frees at once; an in-flight quantum's result for it is ignored).

        The simulated streams are never cancelled, so a live row dropped here is a look-ahead row
        that gave its batch place to a newcomer (``server/core/policy.py``): counted, with its tokens.
        """
        row = self._rows.pop(seq_id, None)
        if row is not None and not row.released:
            self.log.yielded_rows += 1
            self.log.yielded_tokens += row.done

    def encode_voice(self, audio: AudioArray, transcript: str) -> Codes:
        """Not modelled."""
        raise ValueError("the simulated engine makes no voices")

    def warmup(self) -> None:
        """Nothing to warm."""

    def close(self) -> None:
        """Forget every sequence."""
        self._rows.clear()

    def step(self, seq_ids: list[int]) -> list[StepResult]:
        """Launch one quantum for ``seq_ids``; return the results of the quantum read now.

        Without overlap that is this quantum's; with it, the previous one's (this one runs on
        the device meanwhile).
        """
        rows = [self._rows[seq_id] for seq_id in seq_ids if seq_id in self._rows]
        newcomers = [row for row in rows if not row.prefilled]
        slots = sum(1 for row in self._rows.values() if row.prefilled) + len(newcomers)
        if slots > self.slots:
            raise EngineOutOfMemory(f"{slots} rows exceed the {self.slots} KV slots")
        quantum = self._launch(rows, newcomers)
        self.log.peak_slots = max(self.log.peak_slots, slots)
        read, self._inflight = (self._inflight, quantum) if self.overlap else (quantum, None)
        if read is None:
            return []
        self.clock.wait_until(read.end_s)
        self.on_wait()
        self.clock.charge(self.model.read_s)
        self.log.host_reads += 1
        return self._results(read)

    def _launch(self, rows: list[_Row], newcomers: list[_Row]) -> _Quantum:
        """Advance the rows' device state by one quantum and put its cost on the device's timeline."""
        k = self.quantum
        produced: list[tuple[_Row, int, int, bool]] = []
        start_positions = []
        for row in newcomers:
            row.prefilled = True
        for row in rows:
            start_positions.append(row.prompt + row.done)
            if row.ended:  # the host has not read its end yet: a frozen quantum
                continue
            made = min(k, row.total - row.done)
            row.done += made
            row.ended = row.done >= row.total
            window = 0
            if row.ended or row.done >= row.next_target:
                window = row.done - row.decoded
                row.decoded = row.done
                while row.next_target <= row.done:
                    row.next_target = next(row.targets)
            produced.append((row, made, window, row.ended))
        launches = k + (1 if newcomers else 0)
        with self.clock.uncharged():  # the device's own time, not the host's
            log, model = self.log, self.model
            step_s = sum(model.step_s([p + i for p in start_positions]) for i in range(k))
            due = sum(1 for _, _, window, _ in produced if window)
            decode_s = model.decode_s(due)
            prefill_s = model.prefill_s([row.prompt for row in newcomers])
            launches += 1 if due else 0
            log.quanta += 1
            log.rows += len(rows)
            log.frozen_rows += len(rows) - len(produced)
            log.padded_rows += -(-len(rows) // model.row_bucket) * model.row_bucket - len(rows)
            log.tokens += sum(made for _, made, _, _ in produced)
            log.short_rows += sum(1 for _, made, _, ended in produced if made < k and not ended)
            log.step_s += step_s
            log.decode_s += decode_s
            log.prefill_s += prefill_s
            log.decodes += 1 if due else 0
            log.decoded_rows += due
            log.prefills += 1 if newcomers else 0
            log.prefilled_rows += len(newcomers)
        self.clock.charge(launches * model.launch_s)
        start = max(self.clock.now(), self._device_free)
        self._device_free = start + prefill_s + step_s + decode_s
        self.log.busy_until_s = self._device_free
        return _Quantum(self._device_free, produced)

    def _results(self, quantum: _Quantum) -> list[StepResult]:
        """The host's side of one read: each row's tokens, its decoded audio, its end."""
        results = []
        for row, made, window, ended in quantum.produced:
            if row.released or self._rows.get(row.seq_id) is not row:
                continue  # dropped while its quantum ran
            audio = np.zeros(window * SAMPLES_PER_TOKEN, dtype=np.float32)
            if ended:
                row.released = True
                del self._rows[row.seq_id]
            results.append(StepResult(seq_id=row.seq_id, audio=audio, tokens=made, finished=ended))
        return results
