"""The block loop's traffic with the host: one summary read per quantum, uploads that never wait.

A quantum is ``K`` token steps enqueued back to back (``--quantum-tokens``). Between two
quanta the host needs three small facts per row: how many tokens it produced, whether it
still steps, and its KV length. :class:`SummaryReader` brings all three back in ONE
transfer: on CUDA a non-blocking copy into pinned memory and a wait on an event (the wait
ends when the quantum's steps have run, without draining anything queued behind them); on
the CPU one ``tolist()``. Every decision of the block loop (stop when no row steps, end the
block for a waiting command, decode) is taken on that copy, so no other value is read
back while a block runs.

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


class SummaryReader:
    """Reads ``produced``, ``stepping`` and ``lengths`` of slots ``[0, batch)`` in one transfer.

    Args:
        slots: the number of slots (sizes the pinned buffer).
        device: the state's device.
    """

    def __init__(self, slots: int, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        if self._cuda:
            self._host = torch.empty(3 * slots, dtype=torch.long, pin_memory=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        #: Summaries read so far (tests and the engine's counters).
        self.reads = 0

    def read(
        self, batch: int, produced: torch.Tensor, stepping: torch.Tensor, lengths: torch.Tensor
    ) -> BlockSummary:
        """The one device→host read of a quantum: the three ``(S,)`` tensors' first ``batch`` values."""
        summary = torch.stack([produced[:batch], stepping[:batch].long(), lengths[:batch]])
        if self._host is not None and self._event is not None:
            host = self._host[: 3 * batch].view(3, batch)
            host.copy_(summary, non_blocking=True)
            self._event.record()
            self._event.synchronize()
            summary = host
        made, alive, filled = summary.tolist()  # on CUDA a host tensor: no device access
        self.reads += 1
        return BlockSummary(made, alive, filled)


def upload(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as a long tensor on ``device``; on CUDA through pinned memory, without a wait."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.long, device=device)
    staged = torch.tensor(values, dtype=torch.long).pin_memory()
    return staged.to(device, non_blocking=True)
