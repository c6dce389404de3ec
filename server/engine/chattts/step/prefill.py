"""Prefill: the newcomers of one step boundary run into their KV slots together, by prompt bucket.

Every prompt is padded to its bucket (a multiple of ``prefill_bucket`` tokens: few kernel
shapes, flat memory). :meth:`Prefill.run` groups a boundary's newcomers by that length and
runs each group in calls of ``count`` rows, ``count`` a power of two, largest first (seven
rows of one bucket: 4, then 2, then 1). A call is :class:`PrefillStep` at ``(count, length)``:
ChatTTS's embedding of the prompts (speaker included), the Llama's layers, the keys and values
written into each row's slot by a device index, and the rows' slot state set, all from inputs
staged on the host and uploaded without a wait. Like the token step it is a function of two
ints over tensors allocated once, so :mod:`.graphs`' runners run it: eagerly on the CPU, one
captured CUDA graph per ``(count, length)`` on a GPU, and in tests a recording runner that
checks, on the CPU, what a graph relies on.

Why so (each is a test in ``tests/model/test_batched_prefill.py``):

* One call per bucket, not one call padded to the longest newcomer: padded further, a row's
  arithmetic (its attention's length) would depend on its company, and a 20-token prompt
  beside a 300-token one would cost 15 times its work.
* Powers of two: the shapes stay a small closed set that warm-up meets (on the CPU every
  shape holds kernel memory for good, ``bench/results/studies/rss-shapes-epyc-2core.md``; on
  CUDA each is one graph).
* At most ``budget`` tokens (count · length) a call: it bounds one call's activations and the
  shapes warm-up runs. On the CPU it keeps prompts over 256 tokens alone: their products are
  long already, and what batching saves there is the Python around each call (eight short
  and medium newcomers: ``bench/results/studies/prefill-tiny-epyc-2core.md``,
  ``prefill-full-epyc-2core.md``). The CPU's 512 and CUDA's 8192 are starting points, not
  measured optima.
* float32: a row's bits must not depend on who it is prefilled with (a seeded stream alone
  and among others gives the same tokens; failover regenerates exactly). On the CPU a batched
  float32 prefill gives bit for bit the keys, values and states of one at a time (a test
  shows it). cuBLAS picks its kernels by the product's size (split-K), which changes float32
  summation order, so on CUDA float32 prefills one row per call; bf16 and fp16 batch.
* No host sync: ChatTTS's ``Embed.forward`` selects text and code positions with boolean
  masks (a read of their count); here both embeddings are computed everywhere and
  ``torch.where`` picks, the same values bit for bit.

Only ``server/engine/chattts*.py`` import torch; this is one of them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from server.engine.chattts.step.graphs import (
    CudaGraphRunner,
    EagerRunner,
    Shape,
    StepFn,
    StepRunner,
    prepare_or_eager,
)
from server.engine.chattts.step.kv import SlotKV
from server.engine.chattts.step.llama import forward_layers
from server.engine.chattts.step.rows import Row, SlotLayout
from server.engine.chattts.step.sampling import MIN_TEMPERATURE
from server.engine.chattts.step.token_step import JOIN_FLOATS, JOIN_INTS, SlotState

__all__ = ["BUDGET", "EagerPrefill", "Prefill", "PrefillStep", "counts_for", "rows_per_call", "split"]

log = logging.getLogger(__name__)

#: Tokens (count · length) one prefill call holds at most, by device type, when none is given
#: (starting points: on CUDA an eager prefill was launch-bound at 20-37 ms a prompt).
BUDGET = {"cpu": 512, "cuda": 8192}
#: The staged ``ints`` columns: the row's slot, whether it has a speaker embedding, then the
#: columns :meth:`SlotState.join` takes (:data:`JOIN_INTS`; the first, ``lengths``, is the prompt's).
SLOT, SPEAKER, JOIN = 0, 1, 2
LENGTH = JOIN + JOIN_INTS.index("lengths")


def counts_for(length: int, budget: int, most: int) -> tuple[int, ...]:
    """Rows a call at ``length`` runs with: powers of two up to ``budget`` tokens and ``most`` rows (≥ 1)."""
    cap = max(1, min(most, budget // length))
    counts = [1]
    while counts[-1] * 2 <= cap:
        counts.append(counts[-1] * 2)
    return tuple(counts)


def rows_per_call(device: torch.device, dtype: torch.dtype, slots: int) -> int:
    """The most rows one call holds: every slot, but one on CUDA in float32 (see the module docstring)."""
    return 1 if device.type == "cuda" and dtype == torch.float32 else slots


def split(rows: int, counts: tuple[int, ...]) -> list[int]:
    """``rows`` rows as calls of ``counts``' sizes, largest first (7 with counts 1, 2, 4: 4, 2, 1)."""
    calls = []
    for count in reversed(counts):
        while rows >= count:
            calls.append(count)
            rows -= count
    return calls


class PrefillStep:
    """``step(count, length)``: the staged rows ``[0, count)`` through the Llama at ``length``, into slots.

    It reads only its staged inputs (:meth:`Prefill.run` fills them before each call) and
    writes only the KV slots and the slot state, in place (``state`` and ``kv`` are what a
    recording runner checks). The staged prompts are flat buffers of ``capacity`` positions,
    viewed as ``(count, length)``: every call's ``count · length`` fits, whatever its shape.

    Args:
        llama: the loaded ``LlamaModel``.
        kv: the slot cache.
        state: the per-slot state.
        text_w: ``(text vocabulary, hidden)`` ChatTTS's text embedding.
        code_w: ``(num_vq, V, hidden)`` float32 code embeddings, stacked.
        speaker_token: the ``[spk_emb]`` id, whose position takes the speaker embedding.
        rows: the most rows of one call.
        capacity: the most tokens (count · length) of one call.
        empty_code: the repetition history's empty value.
        dtype: the Llama's dtype.
    """

    def __init__(
        self,
        llama: Any,
        kv: SlotKV,
        state: SlotState,
        *,
        text_w: torch.Tensor,
        code_w: torch.Tensor,
        speaker_token: int,
        rows: int,
        capacity: int,
        empty_code: int,
        dtype: torch.dtype,
    ) -> None:
        self.llama, self.kv, self.state = llama, kv, state
        self.text_w, self.code_w, self.speaker_token = text_w, code_w, speaker_token
        self.empty_code, self.dtype = empty_code, dtype
        device, num_vq = state.hidden.device, int(code_w.shape[0])
        self.ids = torch.zeros((capacity, num_vq), dtype=torch.long, device=device)
        self.text_mask = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.speaker = torch.zeros((rows, int(code_w.shape[2])), device=device)
        self.ints = torch.zeros((rows, JOIN + len(JOIN_INTS)), dtype=torch.long, device=device)
        self.floats = torch.zeros((rows, len(JOIN_FLOATS)), device=device)

    def inputs(self) -> dict[str, torch.Tensor]:
        """The staged inputs by name (:meth:`Prefill.run` copies into them)."""
        return {name: getattr(self, name) for name in ("ids", "text_mask", "speaker", "ints", "floats")}

    def __call__(self, count: int, length: int) -> None:
        """Embed, run and join the staged rows; the pad past each prompt is masked by causality.

        Right padding needs no mask: attention is causal, so the real positions never see the
        pad, and the pad's cache entries lie past the prompt (masked, then overwritten).
        """
        st, ints = self.state, self.ints[:count]
        slots = ints[:, SLOT]
        emb = self.embed(count, length)
        positions = st.columns[:length].unsqueeze(0)
        cache = self.kv.prefill_view(slots, length)
        out = forward_layers(self.llama, emb.to(self.dtype), positions, cache, None)
        hidden = out[st.slot_index[:count], ints[:, LENGTH] - 1].float()  # each row's last real token
        floats, empty = self.floats[:count], self.empty_code
        st.join(slots, hidden=hidden, ints=ints[:, JOIN:], floats=floats, empty_code=empty)

    def embed(self, count: int, length: int) -> torch.Tensor:
        """ChatTTS's ``Embed.forward`` then ``Speaker.apply`` on the staged prompts, with no host sync.

        Both embeddings at every position, then a ``where``: the values ChatTTS's masked
        assignments make, bit for bit (its code streams are stacked on the last dimension and
        summed there; so are these). Ids past a table are clamped where the other one is used.
        """
        ids = self.ids[: count * length].view(count, length, -1)
        first = ids[..., 0]
        words = F.embedding(first.clamp(max=self.text_w.shape[0] - 1), self.text_w)
        top = self.code_w.shape[1] - 1
        codes = torch.stack(
            [F.embedding(ids[..., q].clamp(max=top), self.code_w[q]) for q in range(self.code_w.shape[0])],
            dim=-1,
        ).sum(dim=-1)
        text = self.text_mask[: count * length].view(count, length, 1)
        emb = torch.where(text, words, codes.to(words.dtype))
        voiced = first.eq(self.speaker_token) & self.ints[:count, SPEAKER : SPEAKER + 1].bool()
        return torch.where(voiced.unsqueeze(-1), self.speaker[:count].unsqueeze(1).to(emb.dtype), emb)


class Prefill:
    """Prefills newcomers in batched calls: the plan, the staging, the runner and its warm-up.

    Args:
        step: the prefill step.
        layout: sizes (``prefill_bucket``, ``max_len``).
        budget: tokens one call holds at most (a longer prompt runs alone).
        most: rows one call holds at most (1: one at a time).
        runner: runs the step.
    """

    def __init__(
        self, step: PrefillStep, layout: SlotLayout, *, budget: int, most: int, runner: StepRunner
    ) -> None:
        self.step, self.layout, self.budget, self.most = step, layout, budget, most
        self.runner = runner
        #: Why the chosen runner gave way to the eager prefill at warm-up (``None``: it did not).
        self.fallback: str | None = None
        self._cuda = step.state.hidden.device.type == "cuda"

    @classmethod
    def build(
        cls,
        llama: Any,
        kv: SlotKV,
        state: SlotState,
        layout: SlotLayout,
        *,
        text_w: torch.Tensor,
        code_w: torch.Tensor,
        speaker_token: int,
        dtype: torch.dtype,
        budget: int | None,
        cuda_graphs: bool,
    ) -> Prefill:
        """The prefill of a slot batch: ``budget`` ``None`` is :data:`BUDGET` for the device."""
        device = state.hidden.device
        tokens = budget or BUDGET.get(device.type, BUDGET["cuda"])
        most = rows_per_call(device, dtype, layout.slots)
        rows = counts_for(layout.prefill_bucket, tokens, most)[-1]
        step = PrefillStep(
            llama,
            kv,
            state,
            text_w=text_w,
            code_w=code_w,
            speaker_token=speaker_token,
            rows=rows,
            capacity=max(tokens, layout.max_len),
            empty_code=layout.eos + 1,
            dtype=dtype,
        )
        captured = cuda_graphs and device.type == "cuda"
        eager = EagerPrefill(step, every_shape=device.type == "cuda")
        runner: StepRunner = CudaGraphRunner(step, device) if captured else eager
        return cls(step, layout, budget=tokens, most=most, runner=runner)

    def length(self, prompt_tokens: int) -> int:
        """The padded length a prompt of ``prompt_tokens`` tokens is prefilled at (its bucket).

        Never past the last position of a slot; never shorter than the prompt itself.
        """
        bucket, last = self.layout.prefill_bucket, self.layout.max_len - 1
        return max(prompt_tokens, min(-(-prompt_tokens // bucket) * bucket, last))

    def counts(self, length: int) -> tuple[int, ...]:
        """Rows a call at ``length`` may hold."""
        return counts_for(length, self.budget, self.most)

    def calls(self, rows: Sequence[Row]) -> list[tuple[int, list[Row]]]:
        """The plan: ``(length, rows)`` per call; buckets in order of appearance, largest calls first."""
        groups: dict[int, list[Row]] = {}
        for row in rows:
            groups.setdefault(self.length(int(row.input_ids.shape[1])), []).append(row)
        plan = []
        for length, members in groups.items():
            at = 0
            for count in split(len(members), self.counts(length)):
                plan.append((length, members[at : at + count]))
                at += count
        return plan

    def shapes(self, longest_prompt: int) -> list[Shape]:
        """Every ``(count, length)`` a prompt of up to ``longest_prompt`` tokens can be prefilled at."""
        bucket = self.layout.prefill_bucket
        lengths = range(bucket, self.length(longest_prompt) + 1, bucket)
        return [(count, length) for length in lengths for count in self.counts(length)]

    def run(self, rows: Sequence[Row]) -> None:
        """Prefill ``rows`` (none holds a slot yet) into free slots, lowest first; sets their slots, lengths.

        A call that raises gives its slots back (rows of earlier calls keep theirs).
        """
        kv = self.step.kv
        for length, members in self.calls(rows):
            slots = [kv.take() for _ in members]
            try:
                self._stage(members, slots, length)
                for slot in slots:
                    kv.cover(slot, length)
                self.runner.run(len(members), length)
            except BaseException:
                for slot in slots:
                    kv.give_back(slot)
                raise
            for row, slot in zip(members, slots, strict=True):
                row.slot, row.length = slot, int(row.input_ids.shape[1])

    def _stage(self, rows: Sequence[Row], slots: list[int], length: int) -> None:
        """Fill the step's inputs for ``rows`` at ``length``: built on the host, one upload per input.

        The rows' ids are host tensors (the prompt builder's); the pad is id 0, a code position.
        ChatTTS normalizes a speaker embedding where it lies, then moves it; so does this.
        """
        count, num_vq = len(rows), self.step.ids.shape[1]
        ids = torch.zeros((count, length, num_vq), dtype=torch.long)
        text = torch.zeros((count, length), dtype=torch.bool)
        speaker = torch.zeros((count, self.step.speaker.shape[1]))
        ints, floats = [], []
        for i, (row, slot) in enumerate(zip(rows, slots, strict=True)):
            n = int(row.input_ids.shape[1])
            ids[i, :n] = row.input_ids[0]
            text[i, :n] = row.text_mask[0]
            if row.speaker is not None:
                speaker[i] = F.normalize(row.speaker, p=2.0, dim=0, eps=1e-12)
            p = row.request.params
            ints.append([slot, row.speaker is not None, n, row.max_tokens, max(1, p.top_k), *row.key])
            floats.append([max(MIN_TEMPERATURE, p.temperature), min(1.0, max(0.0, p.top_p))])
        step = self.step
        self._upload(step.ids[: count * length], ids.view(count * length, num_vq))
        self._upload(step.text_mask[: count * length], text.view(-1))
        self._upload(step.speaker[:count], speaker)
        self._upload(step.ints[:count], torch.tensor(ints, dtype=torch.long))
        self._upload(step.floats[:count], torch.tensor(floats, dtype=torch.float32))

    def _upload(self, into: torch.Tensor, host: torch.Tensor) -> None:
        """Copy a host tensor into a staged input; on CUDA through pinned memory, without a wait."""
        if self._cuda:
            into.copy_(host.pin_memory(), non_blocking=True)
        else:
            into.copy_(host)

    def prepare(self, longest_prompt: int) -> None:
        """Run (CUDA: capture) every shape once in borrowed slots; a failing capture gives way to eager.

        As the token step's runner (``SlotBatch.prepare_runner``): a GPU user is never stopped
        by a capture that has not run on their GPU before; the eager prefill failing is a fault.
        """
        shapes = self.shapes(longest_prompt)
        kv, st = self.step.kv, self.step.state
        slots = [kv.take() for _ in range(max(count for count, _ in shapes))]
        try:
            # Each row a one-token prompt (its last real token at 0, within every length), no speaker.
            ints = [[slot, 0, 1, 1, 1, 0, 0] for slot in slots]
            self._upload(self.step.ints[: len(slots)], torch.tensor(ints, dtype=torch.long))
            self.runner, reason = prepare_or_eager(
                self.runner, shapes, lambda: EagerPrefill(self.step, every_shape=self._cuda), what="prefill"
            )
            self.fallback = reason or self.fallback  # a later warm-up keeps the first reason
        finally:
            for slot in slots:
                kv.give_back(slot)
                st.lengths[slot] = 0  # as a released row: a step over [0, b) writes it at its first page

    def describe(self) -> dict[str, str]:
        """The prefill's runner and call size, for the engine's info."""
        facts = {"prefill": self.runner.kind, "prefill_tokens": str(self.budget)}
        facts["prefill_rows"] = str(self.most)
        if self.fallback is not None:
            facts["prefill_fallback"] = self.fallback
        return facts


class EagerPrefill(EagerRunner):
    """Calls the prefill step directly; warm-up runs every shape on CUDA, the smallest on the CPU.

    A prefill's products have ``count · length`` rows, so each shape has kernels of its own
    (unlike the token step's, whose kernels depend on the batch alone: :class:`EagerRunner`):
    on CUDA cuBLAS chooses them by size, and warm-up meets every shape. On the CPU a new shape
    costs a oneDNN primitive's set-up, milliseconds against the prefill's own compute, while
    running every shape once was most of the start-up: 97 shapes took 64.4 s of a 66.5 s engine
    warm-up (full-size model, bf16, 2-core AMD EPYC). So the CPU runs the smallest shape only
    (threads, allocator), and the engine's warm-up sequence prefills once more for real.

    Args:
        step: the prefill step, a function of (count, length).
        every_shape: run every shape at :meth:`prepare` (CUDA), else the smallest (the CPU).
    """

    def __init__(self, step: StepFn, *, every_shape: bool) -> None:
        super().__init__(step)
        self.every_shape = every_shape

    def prepare(self, shapes: Sequence[Shape]) -> None:
        """Run every shape once (CUDA) or the smallest (the CPU)."""
        for count, length in shapes if self.every_shape else sorted(shapes)[:1]:
            self._step(count, length)
