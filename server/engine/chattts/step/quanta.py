"""The quanta of one block: launched back to back, each read once, with or without overlap.

A block is a whole number of quanta; a quantum is ``K`` token steps (``--quantum-tokens``)
enqueued with nothing read between them. After each quantum the host reads the rows'
summary once (:mod:`.summary`) and decides: go on, stop because no row steps, or stop
because the core's ``interrupt`` says a command waits.

Without overlap the host reads quantum n before it launches quantum n+1, so the device idles
while the host reads and decides. With overlap (``--overlap-quanta``, on by default on CUDA,
as TensorRT-LLM's overlap scheduler and SGLang's and vLLM's async scheduling do) quantum n+1
is launched before quantum n is read, and the read (a wait on quantum n's event, then the
Python that decides) happens while n+1 runs. What that costs:

* a row that ended in quantum n runs quantum n+1 frozen: the step already leaves a row that
  is not ``stepping`` as it was (no token, no state change), so its tokens and audio are
  those of the synchronous loop;
* a block that stops because no row steps has launched one quantum that nobody needed; its
  summary is not read (nothing in it changed), so there is still one read per quantum run;
* a waiting command ends the block one quantum later: after the quantum in flight, never
  inside one.

On the CPU every launch runs the quantum before it returns, so overlap only adds those
costs; it is off there by default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from server.engine.chattts.step.graphs import StepRunner
from server.engine.chattts.step.kv import bucket_for
from server.engine.chattts.step.summary import BlockSummary, Snapshot, SummaryReader
from server.engine.chattts.step.token_step import SlotState

#: Asked after each quantum of a block but its last: True ends the block at that quantum boundary.
Interrupt = Callable[[], bool]


@dataclass(frozen=True, kw_only=True)
class QuantumLoop:
    """Runs a block's quanta (see the module docstring).

    Attributes:
        quantum: token steps per quantum.
        overlap: launch quantum n+1 before reading quantum n.
        length_buckets: the attention lengths the step runs at.
        max_len: positions per KV slot.
    """

    quantum: int
    overlap: bool
    length_buckets: tuple[int, ...]
    max_len: int

    def run(
        self,
        runner: StepRunner,
        state: SlotState,
        summaries: SummaryReader,
        *,
        batch: int,
        longest: int,
        quanta: int,
        interrupt: Interrupt | None,
    ) -> BlockSummary:
        """Run at most ``quanta`` quanta over slots ``[0, batch)``; the summary after the last one read.

        ``longest``: the longest row's KV length when the block starts (each step attends one
        position further, in the bucket that holds it).
        """
        steps = 0

        def launch() -> Snapshot:
            nonlocal steps
            for _ in range(self.quantum):  # enqueued back to back: no read inside a quantum
                steps += 1
                length = min(longest + steps, self.max_len)
                runner.run(batch, bucket_for(self.length_buckets, length))
            return summaries.snapshot(batch, state.produced, state.stepping, state.lengths)

        if not self.overlap:
            for q in range(quanta):
                summary = summaries.wait(launch())
                if not summary.any_alive or (interrupt is not None and q + 1 < quanta and interrupt()):
                    break
            return summary
        in_flight = [launch()]
        launched = 1
        while True:
            if launched < quanta:  # quantum n+1 goes to the device before quantum n is read
                in_flight.append(launch())
                launched += 1
            summary = summaries.wait(in_flight.pop(0))  # quantum n, read while n+1 runs
            if not in_flight:
                return summary  # the block's last quantum
            if not summary.any_alive:
                return summary  # the quantum in flight runs frozen for every row: nothing to read
            if launched < quanta and interrupt is not None and interrupt():
                quanta = launched  # a command waits: the block ends after the quantum in flight
