"""The engine's sequences that wait for their refinement (``refine: true``), and the jobs refining them.

Sequences that begin refining in the same engine step share one job (one batch, as
``Chat._refine_text`` builds it); every job that holds a sequence named in a step advances by
one block of tokens in that step, between the other streams' token blocks, so a long
refinement never stalls the streams already speaking. The refinement pass itself is
:mod:`server.engine.chattts.refine`; the jobs hold its tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from server.engine.chattts.refine import RefineJob, RefineParams, Refiner, RefineRow
from server.engine_api import SequenceRequest


@dataclass(eq=False)
class _Running:
    job: RefineJob
    requests: list[SequenceRequest]
    rows: list[RefineRow]


@dataclass
class RefineQueue:
    """Sequences waiting for, or in, their refinement.

    Attributes:
        block_tokens: tokens each job generates per engine step.
    """

    block_tokens: int
    _waiting: dict[int, tuple[SequenceRequest, RefineRow]] = field(default_factory=dict)
    _running: list[_Running] = field(default_factory=list)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._waiting or any(
            seq_id == r.seq_id for job in self._running for r in job.requests
        )

    def __len__(self) -> int:
        return len(self._waiting) + sum(len(r.requests) for r in self._running)

    def add(self, request: SequenceRequest, row: RefineRow) -> None:
        """A sequence to refine (``row``: its text, prompt, seed); it starts in the next step naming it."""
        self._waiting[request.seq_id] = (request, row)

    def drop(self, seq_id: int) -> bool:
        """Forget a sequence; its job goes on without it, or ends. Whether it was here."""
        if self._waiting.pop(seq_id, None) is not None:
            return True
        for running in self._running:
            keep = [i for i, r in enumerate(running.requests) if r.seq_id != seq_id]
            if len(keep) == len(running.requests):
                continue
            if keep:
                running.job.keep(keep)
                running.requests = [running.requests[i] for i in keep]
                running.rows = [running.rows[i] for i in keep]
            else:
                self._running.remove(running)
            return True
        return False

    def clear(self) -> None:
        """Forget every sequence (their jobs' state is freed)."""
        self._waiting.clear()
        self._running.clear()

    def advance(
        self, seq_ids: Iterable[int], refiner: Refiner, params: RefineParams
    ) -> list[tuple[SequenceRequest, str]]:
        """One engine step's share of refinement for the named sequences.

        Returns:
            Each sequence whose refinement ended in this step, with its refined text.

        Raises:
            Exception: whatever the refiner raised; the job's sequences wait to start again
                (from their prompts, with the same seeds).
        """
        named = set(seq_ids)
        new = [seq_id for seq_id in self._waiting if seq_id in named]
        if new:
            requests, rows = [self._waiting[s][0] for s in new], [self._waiting[s][1] for s in new]
            job = refiner.start(rows, params)  # prefills; on failure the sequences keep waiting
            for seq_id in new:
                del self._waiting[seq_id]
            self._running.append(_Running(job, requests, rows))
        finished: list[tuple[SequenceRequest, str]] = []
        for running in [r for r in self._running if named.intersection(q.seq_id for q in r.requests)]:
            try:
                done = running.job.advance(self.block_tokens)
            except Exception:
                self._running.remove(running)
                self._waiting.update(
                    (q.seq_id, (q, row)) for q, row in zip(running.requests, running.rows, strict=True)
                )
                raise
            if done:
                self._running.remove(running)
                finished += zip(running.requests, running.job.texts(), strict=True)
        return finished
