"""Static KV slots: the ChatTTS engine's preallocated key/value cache and its shape buckets.

Every layer's keys and values live in one buffer of shape
``(slots, kv_heads, max_len, head_dim)``, allocated once (``slots`` =
``--max-batch``). A sequence takes a free slot when it is prefilled and
gives it back when it ends; its cache never moves, so rows joining and
leaving never copy anyone else's cache, and the memory is known at start-up
(:attr:`SlotKV.nbytes`, logged and exported)::

    bytes = 2 (K and V) · layers · slots · kv_heads · max_len · head_dim · bytes per value

The values are the Llama's dtype on CUDA. On the CPU they are float32 whatever the Llama's
dtype: the token step's attention (:mod:`server.engine.chattts.step.llama`) then reads them
without a conversion, which made it about twice as fast as converting bf16 slices on every
step; and the buffers come from ``calloc`` (through numpy), so the operating system maps
their pages only as positions are written: the reservation is known up front, the resident
memory grows with the positions actually used.

A token step covers slots ``[0, b)`` for ``b`` in :func:`batch_buckets` and
attends over positions ``[0, length)`` for ``length`` in
:func:`length_buckets`, each row masked to its own filled length: a closed,
small set of shapes, each of which warm-up meets (and, on CUDA, captures as
a graph). Slots are handed out lowest first, so the live rows stay packed at
the front and ``b`` tracks the number of rows.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache

#: Attention lengths double up to the step (16, 32, ...) and then grow by it: finer on the CPU,
#: where attending over padding costs memory bandwidth, coarser on CUDA, where each length is
#: one more captured graph per batch size.
LENGTH_STEP = {"cpu": 64, "cuda": 128}


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes a step runs at: powers of two below ``max_batch``, then ``max_batch`` itself."""
    if max_batch < 1:
        raise ValueError("max_batch must be at least 1")
    sizes = []
    b = 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return (*sizes, max_batch)


def length_buckets(max_len: int, step: int) -> tuple[int, ...]:
    """Attention lengths a step runs at: 16, 32, ... to ``step``, then multiples of it, and ``max_len``."""
    sizes = []
    n = min(16, step)
    while n < step and n < max_len:
        sizes.append(n)
        n *= 2
    n = step
    while n < max_len:
        sizes.append(n)
        n += step
    return (*sizes, max_len)


def bucket_for(buckets: tuple[int, ...], n: int) -> int:
    """The smallest bucket holding ``n`` (``ValueError`` past the largest)."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def kv_dtype(model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV slots' dtype: the model's on CUDA, float32 on the CPU (see the module docstring)."""
    return model_dtype if device.type == "cuda" else torch.float32


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on the CPU from ``calloc``, so untouched pages take no resident memory."""
    if device.type == "cpu" and dtype == torch.float32:
        return torch.from_numpy(np.zeros(shape, dtype=np.float32))
    return torch.zeros(shape, dtype=dtype, device=device)


class SlotKV:
    """Per-layer key/value buffers of every slot, and which slots are free.

    Args:
        layers: transformer layers.
        slots: rows of the cache (the most sequences alive at once).
        kv_heads: key/value heads.
        max_len: positions per slot (prompt + generated tokens).
        head_dim: size of one head.
        dtype: the values' dtype (:func:`kv_dtype`).
        device: the model device.
    """

    def __init__(
        self,
        *,
        layers: int,
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (slots, kv_heads, max_len, head_dim)
        # Zeros, not empty: a masked position still enters the attention product (times 0),
        # and uninitialized memory may hold NaN, which 0 · NaN would spread.
        self.keys = [_zeros(shape, dtype, device) for _ in range(layers)]
        self.values = [_zeros(shape, dtype, device) for _ in range(layers)]
        self.slots = slots
        self._free = list(range(slots))  # a heap: the lowest free slot first

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def free_slots(self) -> int:
        """Slots not taken."""
        return len(self._free)

    def take(self) -> int:
        """The lowest free slot (``IndexError`` when none is free)."""
        if not self._free:
            raise IndexError("every KV slot is taken")
        return heapq.heappop(self._free)

    def give_back(self, slot: int) -> None:
        """Free ``slot``; its stale contents stay (masked out until overwritten)."""
        if slot in self._free or not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not taken")
        heapq.heappush(self._free, slot)

    def prefill_view(self, slot: int, length: int) -> PrefillCache:
        """A cache that writes a prefill's ``length`` positions into ``slot``."""
        return PrefillCache(self, slot, length)

    def step_view(self, rows: torch.Tensor, positions: torch.Tensor, length: int) -> StepCache:
        """A cache that writes one position per row (``positions``) and attends over ``[0, length)``."""
        return StepCache(self, rows, positions, length)


class PrefillCache(Cache):
    """Writes positions ``[0, length)`` of one slot; attention sees exactly those (causal)."""

    def __init__(self, kv: SlotKV, slot: int, length: int) -> None:
        super().__init__(layers=[])
        self._kv, self._slot, self._length = kv, slot, length

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy ``(1, heads, length, dim)`` states into the slot; attention uses them as they are.

        A fresh slot holds nothing before the prompt, so the states are all there is to attend.
        """
        s, n = self._slot, self._length
        self._kv.keys[layer_idx][s : s + 1, :, :n].copy_(key_states)
        self._kv.values[layer_idx][s : s + 1, :, :n].copy_(value_states)
        return key_states, value_states


class StepCache(Cache):
    """Writes one position per row at ``positions`` and returns slots ``[0, b)`` over ``[0, length)``.

    Rows are slots ``[0, b)`` in order (``rows`` is ``arange(b)``, kept by the caller so that
    a captured step allocates nothing from host data). Rows outside the step's own sequences
    write at their current length, which lies past their filled part: it is masked, and
    overwritten when that row next steps.
    """

    def __init__(self, kv: SlotKV, rows: torch.Tensor, positions: torch.Tensor, length: int) -> None:
        super().__init__(layers=[])
        self._kv, self._rows, self._positions, self._length = kv, rows, positions, length

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``(b, heads, 1, dim)`` states at each row's position; return the attended views."""
        b, n = self._rows.shape[0], self._length
        keys, values = self._kv.keys[layer_idx], self._kv.values[layer_idx]
        keys[self._rows, :, self._positions] = key_states[:, :, 0].to(keys.dtype)
        values[self._rows, :, self._positions] = value_states[:, :, 0].to(values.dtype)
        return keys[:b, :, :n], values[:b, :, :n]
