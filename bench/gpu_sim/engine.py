"""The simulated engine of ``python -m bench.gpu_sim``: the engine interface over a modelled device.

:class:`QuantumEngine` implements the engine interface (``server.engine_api.Engine``) the way
issue #43 designs the CUDA engine: every row advances a fixed ``K`` tokens per quantum (nothing
cuts one short: it has no ``interrupt``), the newcomers of one boundary are prefilled in one
call, the rows due for audio are decoded in one captured call, the host reads once per quantum,
and with ``overlap`` quantum n+1 is launched before quantum n is read (a row that ended runs one
frozen quantum). Each quantum's device time is priced by :class:`~bench.gpu_sim.model.CostModel`
and put on a :class:`~bench.gpu_sim.clock.VirtualClock`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from bench.gpu_sim.clock import VirtualClock
from bench.gpu_sim.model import CostModel
from bench.gpu_sim.tokens import BLOCK_SCHEDULE, SAMPLES_PER_TOKEN, decode_targets, segment_tokens
from server.engine_api import (
    AudioArray,
    Codes,
    EngineInfo,
    EngineOutOfMemory,
    SequenceRequest,
    StepResult,
)


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
