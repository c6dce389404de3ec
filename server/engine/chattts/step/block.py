"""One block over prefilled rows: its quanta, its tokens into the decode ring, one batched decode.

1. the block is as long as the fewest tokens any row needs to reach its next decode, in
   whole quanta (the schedule's blocks are multiples of the quantum);
2. ``begin_block`` marks the rows' slots as stepping (one small upload), and the quanta run
   (:mod:`.quanta`: one host read per quantum, overlapped with the next quantum where
   ``--overlap-quanta`` is on); the block stops early when no row steps, or after the quantum in
   flight when the core's ``interrupt`` says a command waits;
3. every row's new hidden states go into the decode ring in one indexed copy (:mod:`.ring`);
4. every row whose own block schedule says it is due (or that ended) plans its window, and the
   windows come out of the ring in one indexed gather for one batched Decoder + Vocos call.

A row decodes every ``block_schedule[k]`` tokens of its own, whatever the other rows do: a
newcomer's short first block does not make every other row decode (and re-decode context)
after 8 tokens; and an early end changes neither tokens nor audio (the rest of the block is
the next one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from server.engine.chattts.decode import DecodeSpan
from server.engine.chattts.step.graphs import StepRunner
from server.engine.chattts.step.kv import SlotKV, bucket_for
from server.engine.chattts.step.quanta import Interrupt, QuantumLoop
from server.engine.chattts.step.ring import DecodeRing, Span
from server.engine.chattts.step.rows import Row
from server.engine.chattts.step.summary import BlockSummary, SummaryReader
from server.engine.chattts.step.token_step import SlotState
from server.engine.chattts.vocode import BatchVocoder
from server.engine_api import StepResult

#: ``(seq_id, codes (k, num_vq) long, hiddens (k, hidden) float32)`` of the k audio tokens a
#: sequence accepted in one step (EOS excluded), on the CPU. Tests compare them with ChatTTS's own.
TokenTap = Callable[[int, torch.Tensor, torch.Tensor], None]

_EMPTY = np.zeros(0, dtype=np.float32)


@dataclass(eq=False, kw_only=True)
class BlockLoop:
    """Runs blocks over the slot machinery it is given (see the module docstring).

    Attributes:
        state, kv, summaries: the slots' state, KV cache and summary reader.
        ring: the decode ring.
        vocoder: the batched Decoder + Vocos.
        quanta: the quantum loop.
        batch_buckets: the batch sizes the step runs at.
        block_schedule: tokens between a row's decodes (the last repeats).
    """

    state: SlotState
    kv: SlotKV
    summaries: SummaryReader
    ring: DecodeRing
    vocoder: BatchVocoder
    quanta: QuantumLoop
    batch_buckets: tuple[int, ...]
    block_schedule: tuple[int, ...]

    def target(self, row: Row) -> int:
        """Tokens between the row's previous decode and its next one."""
        schedule = self.block_schedule
        return schedule[min(row.decodes, len(schedule) - 1)]

    def run(
        self,
        runner: StepRunner,
        rows: list[Row],
        token_tap: TokenTap | None = None,
        interrupt: Interrupt | None = None,
    ) -> list[StepResult]:
        """One block for prefilled ``rows``; a row that ended is reported ``finished`` (not released)."""
        quantum = self.quanta.quantum
        block = min(self.target(r) - r.undecoded for r in rows)
        quanta = max(1, -(-block // quantum))  # whole: the schedule's blocks are multiples of the quantum
        batch = bucket_for(self.batch_buckets, max(r.slot for r in rows) + 1)
        self.state.begin_block([r.slot for r in rows])
        longest = max(r.length for r in rows)
        summary = self.quanta.run(
            runner,
            self.state,
            self.summaries,
            batch=batch,
            longest=longest,
            quanta=quanta,
            interrupt=interrupt,
        )
        return self._end(rows, summary, token_tap)

    def _end(self, rows: list[Row], summary: BlockSummary, token_tap: TokenTap | None) -> list[StepResult]:
        """The block's tokens into the ring (one copy for all rows); every due row decoded in one call."""
        st, produced, alive = self.state, summary.produced, summary.alive
        for slot, length in enumerate(summary.lengths):  # every row of [0, batch) wrote at its length
            self.kv.cover(slot, length + 1)
        self.ring.write(st.pending_hidden, [(row.slot, produced[row.slot]) for row in rows])
        if token_tap is not None:  # tests: copies, since the buffers are reused by the next block
            for row in rows:
                if not (k := produced[row.slot]):
                    continue
                codes = st.pending_codes[row.slot, :k].to("cpu", copy=True)
                token_tap(row.request.seq_id, codes, st.pending_hidden[row.slot, :k].to("cpu", copy=True))
        due: list[tuple[Row, bool]] = []
        for row in rows:
            row.length = summary.lengths[row.slot]
            row.undecoded += produced[row.slot]
            row.decoder.advance(produced[row.slot])
            finished = not alive[row.slot]
            if finished or row.undecoded >= self.target(row):
                row.decodes += 1
                row.undecoded = 0
                due.append((row, finished))
        audio = self.decode(due)
        return [
            StepResult(
                seq_id=row.request.seq_id,
                audio=audio.get(row.request.seq_id, _EMPTY),
                tokens=produced[row.slot],
                finished=not alive[row.slot],
            )
            for row in rows
        ]

    def decode(self, due: list[tuple[Row, bool]]) -> dict[int, npt.NDArray[np.float32]]:
        """The decode stage: each due row plans its span; one gather from the ring, one batched call."""
        planned: list[tuple[Row, DecodeSpan]] = []
        for row, finished in due:
            span = row.decoder.span(final=finished)
            if span is not None:
                planned.append((row, span))
        if not planned:
            return {}
        spans = [Span(row.slot, span.start_token, span.tokens) for row, span in planned]

        def gather(indices: list[int], tokens: int) -> torch.Tensor:
            return self.ring.gather([spans[i] for i in indices], tokens)

        wavs = self.vocoder.decode_gathered([span.tokens for _, span in planned], gather)
        done = zip(planned, wavs, strict=True)
        return {row.request.seq_id: row.decoder.finish(span, wav) for (row, span), wav in done}
