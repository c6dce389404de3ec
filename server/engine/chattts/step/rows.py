"""What the block loop holds: one row per sequence, and the sizes of the static machinery."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.engine.chattts.decode import StreamDecoder
from server.engine_api import SequenceRequest


@dataclass
class Row:
    """One sequence as the engine holds it."""

    request: SequenceRequest
    input_ids: torch.Tensor  # (1, n, num_vq), on the host: the prefill stages it (step/prefill.py)
    text_mask: torch.Tensor  # (1, n), on the host
    speaker: torch.Tensor | None  # None: a voice from a recording ([empty_spk] + its codes)
    key: tuple[int, int]
    decoder: StreamDecoder
    max_tokens: int
    slot: int = -1  # -1 until prefilled
    length: int = 0  # filled KV positions (host copy, refreshed every block)
    decodes: int = 0  # decode windows so far: the position in the block schedule
    undecoded: int = 0  # tokens pushed since the last decode


@dataclass(frozen=True, kw_only=True)
class SlotLayout:
    """Sizes of the static machinery.

    Attributes:
        layers, kv_heads, head_dim, hidden_size, num_vq: the model's.
        slots: KV slots (``--max-batch``).
        max_len: positions per slot.
        block_schedule: tokens between a row's decodes (last repeats).
        eos: the end code.
        prefill_bucket: prompts are prefilled padded to a multiple of this (1: unpadded).
        quantum: token steps enqueued back to back between two host reads; every block is a
            whole number of quanta, so it divides every entry of ``block_schedule``.

    Raises:
        ValueError: from the constructor, for a quantum that does not divide the schedule.
    """

    layers: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    num_vq: int
    slots: int
    max_len: int
    block_schedule: tuple[int, ...]
    eos: int
    prefill_bucket: int = 1
    quantum: int = 1

    def __post_init__(self) -> None:
        if self.quantum < 1 or any(block % self.quantum for block in self.block_schedule):
            raise ValueError(
                f"quantum {self.quantum}: must be at least 1 and divide every block of {self.block_schedule}"
            )
