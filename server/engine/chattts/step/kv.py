"""Static KV slots: the ChatTTS engine's key/value cache, reserved once, and its shape buckets.

Every layer's keys and values live in one buffer of shape
``(slots, kv_heads, max_len, head_dim)`` (``slots`` = ``--max-batch``). A sequence takes a
free slot when it is prefilled and gives it back when it ends; its cache never moves, so rows
joining and leaving never copy anyone else's cache. The reservation is known at start-up
(:attr:`SlotKV.nbytes`, logged and exported)::

    bytes = 2 (K and V) · layers · slots · kv_heads · max_len · head_dim · bytes per value

On CUDA that is what the device holds, from start-up on. On the CPU it is address space: the
buffers are one anonymous mapping (:mod:`server.engine.chattts.step.pages`) whose pages become
resident as positions are written, and a slot given back hands its pages back to the system,
so the resident memory (:attr:`SlotKV.resident_bytes`) follows the positions the live rows
hold, not every slot at its worst case. The values are the Llama's dtype on CUDA and under
the CPU's compiled step (``--compile-step on``), and float32 on the eager CPU step whatever
the Llama's dtype. Eagerly, the token step's attention (:mod:`server.engine.chattts.step.llama`)
then reads them without a conversion, which made it about twice as fast as converting bf16
slices on every step. Compiled, inductor fuses the conversion into the attention's reads, so
bf16 slots halve both the memory and the bytes every step reads: at 8 rows over 320
positions the 20 layers' attention took 12.7 ms against 17.2 ms from float32 slots (EPYC,
2 threads). No value changes: the keys and values are bf16 when the step makes them. A compiled
step that gives way to the eager one at warm-up keeps its bf16 slots (the eager attention then
converts them: correct, a little slower).

A token step covers slots ``[0, b)`` for ``b`` in :func:`batch_buckets` and
attends over positions ``[0, length)`` for ``length`` in
:func:`length_buckets`, each row masked to its own filled length: a closed,
small set of shapes, each of which warm-up meets (and, on CUDA, captures as
a graph). Slots are handed out lowest first, so the live rows stay packed at
the front and ``b`` tracks the number of rows. The token step reads every row of
``[0, b)`` over ``[0, length)``; an unwritten page reads as the shared zero page, which
costs no memory.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Any

import torch
from transformers.cache_utils import Cache

from server.engine.chattts.step.pages import PAGE, PageReservation, can_release, can_reserve

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


def kv_dtype(model_dtype: torch.dtype, device: torch.device, *, compiled: bool = False) -> torch.dtype:
    """The KV slots' dtype: the model's on CUDA and under the CPU's compiled step, else float32.

    See the module docstring. The keys and values a step stores are the model's dtype
    already (its projections' output), so slots of that dtype lose nothing.
    """
    return model_dtype if device.type == "cuda" or compiled else torch.float32


class SlotKV:
    """Per-layer key/value buffers of every slot, which slots are free, and what is resident.

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
        self.slots, self.max_len = slots, max_len
        self._layers, self._heads = layers, kv_heads
        self._run_bytes = head_dim * dtype.itemsize  # one position of one head
        self._slot_bytes = kv_heads * max_len * self._run_bytes  # one slot of one layer's K (or V)
        self._pages: PageReservation | None = None
        # Zeros, not empty: a masked position still enters the attention product (times 0),
        # and uninitialized memory may hold NaN, which 0 · NaN would spread.
        if device.type == "cpu" and can_reserve():
            self._pages = PageReservation(2 * layers * slots * self._slot_bytes)
            count = 2 * layers * slots * kv_heads * max_len * head_dim
            both = torch.frombuffer(self._pages.buffer, dtype=dtype, count=count).view(layers, 2, *shape)
            self.keys = [both[layer, 0] for layer in range(layers)]
            self.values = [both[layer, 1] for layer in range(layers)]
        else:
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self._free = list(range(slots))  # a heap: the lowest free slot first
        #: Per slot, the positions ``[0, n)`` that may have been written since it was last released.
        self._extent = [0] * slots

    @property
    def nbytes(self) -> int:
        """Bytes reserved by all buffers (the most the cache can hold)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def lazy(self) -> bool:
        """Whether pages become resident only when written and go back when a slot is freed (the CPU).

        Elsewhere than Linux the CPU's slots are still a lazy mapping, but freed pages stay
        resident, so :attr:`resident_bytes` reports the reservation there.
        """
        return self._pages is not None and can_release()

    @property
    def resident_bytes(self) -> int:
        """Bytes of the cache in memory: all of it on a device; on the CPU, the pages written.

        On the CPU: for every slot, each head's first ``n`` positions rounded up to whole
        pages, ``n`` the positions written since the slot was last released (the step writes
        one position past a row's filled part, a prefill its padded length). Where a head's
        positions do not start on a page boundary the kernel may count one page more per head.
        """
        if not self.lazy:
            return self.nbytes
        runs = 2 * self._layers * self._heads
        return runs * sum(-(-n * self._run_bytes // PAGE) * PAGE for n in self._extent)

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
        """Free ``slot`` and, on the CPU, hand its pages back (they read as zeros until written again)."""
        if slot in self._free or not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not taken")
        self._release(slot)
        heapq.heappush(self._free, slot)

    def trim(self) -> None:
        """Hand back the pages of every free slot (warm-up writes into slots it does not hold)."""
        for slot in self._free:
            self._release(slot)

    def cover(self, slot: int, positions: int) -> None:
        """Note that ``slot``'s positions ``[0, positions)`` may be written (:attr:`resident_bytes`)."""
        self._extent[slot] = max(self._extent[slot], min(positions, self.max_len))

    def _release(self, slot: int) -> None:
        self._extent[slot] = 0
        if self._pages is None:
            return
        for layer_kv in range(2 * self._layers):  # each layer's K, then its V: one region per slot each
            start = (layer_kv * self.slots + slot) * self._slot_bytes
            self._pages.release(start, start + self._slot_bytes)

    def prefill_view(self, slots: torch.Tensor, length: int) -> PrefillCache:
        """A cache that writes a prefill's ``length`` positions into ``slots[i]`` for batch row ``i``.

        ``slots`` is device data (a captured prefill allocates nothing from host data): the
        caller notes the positions (:meth:`cover`) on the host, where it chose the slots.
        """
        return PrefillCache(self, slots, length)

    def step_view(self, rows: torch.Tensor, positions: torch.Tensor, length: int) -> StepCache:
        """A cache that writes one position per row (``positions``) and attends over ``[0, length)``.

        The positions are device data: the caller notes them (:meth:`cover`) once the block's
        lengths are read back.
        """
        return StepCache(self, rows, positions, length)


class PrefillCache(Cache):
    """Writes positions ``[0, length)`` of one slot per batch row; attention sees exactly those (causal)."""

    def __init__(self, kv: SlotKV, slots: torch.Tensor, length: int) -> None:
        super().__init__(layers=[])
        self._kv, self._slots, self._length = kv, slots, length

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy ``(count, heads, length, dim)`` states into their slots by index; attend them as they are.

        One indexed copy for every row (no copy per row); a fresh slot holds nothing before the
        prompt, so the states are all there is to attend.
        """
        n = self._length
        keys, values = self._kv.keys[layer_idx], self._kv.values[layer_idx]
        keys[:, :, :n].index_copy_(0, self._slots, key_states.to(keys.dtype))
        values[:, :, :n].index_copy_(0, self._slots, value_states.to(values.dtype))
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
