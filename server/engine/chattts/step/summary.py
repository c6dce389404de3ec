"""The block loop's traffic with the host: one summary read per quantum, uploads that never wait.

A quantum is ``K`` token steps enqueued back to back (``--quantum-tokens``). Between two
quanta the host needs three small facts per row: how many tokens it produced, whether it
still steps, and its KV length. :class:`SummaryReader` brings all three back in ONE
transfer: on CUDA a non-blocking copy into pinned memory and a wait on an event (the wait
ends when the quantum's steps have run, without draining anything queued behind them); on
the CPU one ``tolist()``. Every decision of the block loop (stop when no row steps, end the
block for a waiting command, decode) is taken on that copy, so no other value is read
back while a block runs.

The read is two calls so that the block loop can overlap it with the next quantum
(``--overlap-quanta``, :mod:`.quanta`): :meth:`SummaryReader.snapshot` enqueues the copy right
behind quantum n's steps, and :meth:`SummaryReader.wait` reads it, after quantum n+1 has
been launched. Two pinned buffers take turns, so quantum n+1's copy never lands in the
buffer the host is reading.

:func:`upload` sends host lists to the device without waiting: a plain ``torch.tensor(...,
device="cuda")`` copies from pageable memory and synchronizes the stream, a hidden host
sync per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockSummary:
    """Per-slot facts of slots ``[0, batch)`` after a quantum, on the host.

    Attributes:
        produced: tokens each slot accepted in this block so far.
        alive: 1 where a slot still steps (has not ended, takes part in the block), else 0.
        lengths: each slot's filled KV positions.
    """

    produced: list[int]
    alive: list[int]
    lengths: list[int]

    @property
    def any_alive(self) -> bool:
        """Some row of the block still steps."""
        return any(self.alive)


@dataclass(frozen=True)
class Snapshot:
    """One quantum's summary, copied on the device side and not read yet (:meth:`SummaryReader.wait`).

    Attributes:
        values: ``(3, batch)`` long: on the CPU a copy; on CUDA the pinned buffer it lands in.
        event: on CUDA, recorded behind the copy; ``None`` on the CPU.
    """

    values: torch.Tensor
    event: torch.cuda.Event | None


class SummaryReader:
    """Reads ``produced``, ``stepping`` and ``lengths`` of slots ``[0, batch)`` in one transfer.

    Args:
        slots: the number of slots (sizes the pinned buffers).
        device: the state's device.
    """

    def __init__(self, slots: int, device: torch.device) -> None:
        self._host: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event] = []
        if device.type == "cuda":  # two of each: quantum n+1's copy is queued while n's is read
            self._host = [torch.empty(3 * slots, dtype=torch.long, pin_memory=True) for _ in range(2)]
            self._events = [torch.cuda.Event() for _ in range(2)]  # type: ignore[no-untyped-call]
        self._turn = 0
        #: Summaries read so far (tests and the engine's counters).
        self.reads = 0

    def snapshot(
        self, batch: int, produced: torch.Tensor, stepping: torch.Tensor, lengths: torch.Tensor
    ) -> Snapshot:
        """Copy the three ``(S,)`` tensors' first ``batch`` values now, in stream order; wait for nothing."""
        summary = torch.stack([produced[:batch], stepping[:batch].long(), lengths[:batch]])
        if not self._host:
            return Snapshot(summary, None)  # the CPU: stack made a copy the next steps cannot touch
        turn, self._turn = self._turn, 1 - self._turn
        host = self._host[turn][: 3 * batch].view(3, batch)
        host.copy_(summary, non_blocking=True)
        event = self._events[turn]
        event.record()
        return Snapshot(host, event)

    def wait(self, snapshot: Snapshot) -> BlockSummary:
        """The one device→host read of a quantum: wait for its copy (CUDA) and read it."""
        if snapshot.event is not None:
            snapshot.event.synchronize()
        made, alive, filled = snapshot.values.tolist()  # on CUDA a host tensor: no device access
        self.reads += 1
        return BlockSummary(made, alive, filled)

    def read(
        self, batch: int, produced: torch.Tensor, stepping: torch.Tensor, lengths: torch.Tensor
    ) -> BlockSummary:
        """:meth:`snapshot` and :meth:`wait` at once: the summary of the quantum just enqueued."""
        return self.wait(self.snapshot(batch, produced, stepping, lengths))


def upload(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as a long tensor on ``device``; on CUDA through pinned memory, without a wait."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.long, device=device)
    staged = torch.tensor(values, dtype=torch.long).pin_memory()
    return staged.to(device, non_blocking=True)
