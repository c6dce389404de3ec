"""One engine step over KV-slot rows: the slot machinery, prefill into slots, and its blocks.

:class:`SlotBatch` owns the static machinery (KV slots, slot state, token step and its
runner, the decode ring and the batched vocoder) and runs one block for the rows it is given
through :class:`.block.BlockLoop` (the block's quanta: :mod:`.quanta`; its decodes: the ring,
:mod:`.ring`, and :mod:`server.engine.chattts.vocode`).
Newcomers are prefilled first, together (:mod:`.prefill`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from server.engine.chattts.step import decode_attention
from server.engine.chattts.step.block import BlockLoop, TokenTap
from server.engine.chattts.step.compiled import CompiledRunner
from server.engine.chattts.step.graphs import (
    CudaGraphRunner,
    EagerRunner,
    StepFn,
    StepRunner,
    prepare_or_eager,
)
from server.engine.chattts.step.kv import (
    LENGTH_STEP,
    SlotKV,
    batch_buckets,
    kv_dtype,
    length_buckets,
)
from server.engine.chattts.step.prefill import Prefill
from server.engine.chattts.step.quanta import Interrupt, QuantumLoop
from server.engine.chattts.step.ring import DecodeRing
from server.engine.chattts.step.ring import ring_tokens as ring_tokens_for
from server.engine.chattts.step.rows import Row, SlotLayout
from server.engine.chattts.step.summary import SummaryReader
from server.engine.chattts.step.token_step import SlotState, TokenStep
from server.engine.chattts.vocode import BatchVocoder
from server.engine.chattts.vocode import vocoder_dtype as vocoder_dtype_of
from server.engine_api import StepResult

__all__ = ["Interrupt", "Row", "RunnerFactory", "SlotBatch", "SlotLayout", "TokenTap"]

log = logging.getLogger(__name__)

#: Positions a compiled step's KV slots hold past the longest attention length (see ``SlotBatch``).
SPARE_POSITIONS = 1

#: Builds the step runner around the static step (tests pass a recording one).
RunnerFactory = Callable[[StepFn], StepRunner]


class SlotBatch:
    """KV slots, slot state, the token step and its runner, and the batched vocoder.

    Args:
        llama: the loaded ``LlamaModel``.
        layout: sizes.
        head_w, code_w: ``(num_vq, V, hidden)`` float32 code heads and embeddings.
        text_w: ``(text vocabulary, hidden)`` ChatTTS's text embedding (the prefill's).
        speaker_token: the ``[spk_emb]`` id, where a prompt takes its speaker embedding.
        vocoder: the batched Decoder + Vocos.
        dtype, device: the Llama's.
        min_tokens: EOS is banned before this many tokens.
        repetition_penalty: ChatTTS's penalty.
        cuda_graphs: capture the step as CUDA graphs (on a CUDA device only).
        compile_step: compile the step with inductor (on the CPU only).
        step_runner: overrides the runner (tests).
        overlap: launch quantum n+1 before reading quantum n (:mod:`.quanta`).
        ring_tokens: the decode ring's tokens per slot (:func:`.ring.ring_tokens`; ``None``:
            for the decoder's default context and hold-back).
        prefill_tokens: tokens one prefill call holds at most (``None``: the device's default).
    """

    def __init__(
        self,
        llama: Any,
        layout: SlotLayout,
        *,
        head_w: torch.Tensor,
        code_w: torch.Tensor,
        text_w: torch.Tensor,
        speaker_token: int,
        vocoder: BatchVocoder,
        dtype: torch.dtype,
        device: torch.device,
        min_tokens: int,
        repetition_penalty: float,
        cuda_graphs: bool,
        compile_step: bool = False,
        step_runner: RunnerFactory | None = None,
        overlap: bool = False,
        ring_tokens: int | None = None,
        prefill_tokens: int | None = None,
    ) -> None:
        self.layout = layout
        compiled = step_runner is None and compile_step and device.type == "cpu"
        self.batch_buckets = batch_buckets(layout.slots)
        self.length_buckets = length_buckets(
            layout.max_len, LENGTH_STEP.get(device.type, LENGTH_STEP["cuda"])
        )
        self.kv = SlotKV(
            layers=layout.layers,
            slots=layout.slots,
            kv_heads=layout.kv_heads,
            # Compiled: one position more than any step attends over. A view of all of a slot's
            # positions is contiguous where any shorter one is not, and dynamo traced that longest
            # length as graphs of their own (compiled.py: why two graphs, not four).
            max_len=layout.max_len + (SPARE_POSITIONS if compiled else 0),
            head_dim=layout.head_dim,
            dtype=kv_dtype(dtype, device, compiled=compiled),
            device=device,
        )
        self.state = SlotState.allocate(
            slots=layout.slots,
            hidden_size=layout.hidden_size,
            num_vq=layout.num_vq,
            block=max(layout.block_schedule),
            # The positions' columns, as long as a slot: no compiled step's mask views all of them
            max_len=layout.max_len + (SPARE_POSITIONS if compiled else 0),
            empty_code=layout.eos + 1,
            device=device,
        )
        self.token_step = TokenStep(
            llama,
            self.kv,
            self.state,
            head_w=head_w,
            code_w=code_w,
            eos=layout.eos,
            min_tokens=min_tokens,
            repetition_penalty=repetition_penalty,
            dtype=dtype,
            # compiled on the CPU: batches read each row only as far as it reaches, where it builds
            attend=decode_attention.step_attention if compiled and decode_attention.load() else None,
        )
        self.prefiller = Prefill.build(
            llama,
            self.kv,
            self.state,
            layout,
            text_w=text_w,
            code_w=code_w,
            speaker_token=speaker_token,
            dtype=dtype,
            budget=prefill_tokens,
            cuda_graphs=cuda_graphs and step_runner is None,
        )
        self.vocoder = vocoder
        self.summaries = SummaryReader(layout.slots, device)
        if ring_tokens is None:
            ring_tokens = ring_tokens_for(
                context_tokens=16, holdback_tokens=4, block_schedule=layout.block_schedule
            )
        self.ring = DecodeRing(layout.slots, ring_tokens, layout.hidden_size, device)
        self.block = BlockLoop(
            state=self.state,
            kv=self.kv,
            summaries=self.summaries,
            ring=self.ring,
            vocoder=vocoder,
            quanta=QuantumLoop(
                quantum=layout.quantum,
                overlap=overlap,
                length_buckets=self.length_buckets,
                max_len=layout.max_len,
            ),
            batch_buckets=self.batch_buckets,
            block_schedule=layout.block_schedule,
        )
        if step_runner is not None:
            self.runner: StepRunner = step_runner(self.token_step)
        elif cuda_graphs and device.type == "cuda":
            self.runner = CudaGraphRunner(self.token_step, device)
        elif compiled:
            self.runner = CompiledRunner(self.token_step)
        else:
            self.runner = EagerRunner(self.token_step)
        #: Why the chosen runner gave way to the eager step at warm-up (``None``: it did not).
        self.runner_fallback: str | None = None
        self.runner_prepared = False

    def prepare_runner(self, shapes: list[tuple[int, int]]) -> None:
        """Prepare the runner at every shape; a capturing runner that fails gives way to eager.

        :func:`.graphs.prepare_or_eager` says why in the engine's info and one loud log line.
        """
        self.runner, reason = prepare_or_eager(
            self.runner, shapes, lambda: EagerRunner(self.token_step), what="token step"
        )
        self.runner_fallback = reason or self.runner_fallback  # a later warm-up keeps the first reason
        self.runner_prepared = True

    def describe(self) -> dict[str, str]:
        """KV slots, memory and shape buckets, for the engine's info and the start-up log."""
        facts = {
            "kv_slots": str(self.layout.slots),
            "kv_max_len": str(self.layout.max_len),
            "kv_cache_bytes": str(self.kv.nbytes),
            "token_step": self.runner.kind,
            "quantum_tokens": str(self.layout.quantum),
            "overlap_quanta": "on" if self.block.quanta.overlap else "off",
            "decode_ring_tokens": str(self.ring.capacity),
            "attention": getattr(self.token_step.attend, "__name__", "custom"),
            "vocoder_dtype": str(self.vocoder.dtype).removeprefix("torch."),
            "batch_buckets": ",".join(map(str, self.batch_buckets)),
            "length_buckets": ",".join(map(str, self.length_buckets)),
            **self.prefiller.describe(),
        }
        if self.runner_fallback is not None:
            facts["token_step_fallback"] = self.runner_fallback
        return facts

    def shapes(self) -> list[tuple[int, int]]:
        """Every (batch, attention length) a token step can run at: the closed bucket set."""
        return [(b, n) for b in self.batch_buckets for n in self.length_buckets]

    @classmethod
    def for_chat(
        cls,
        chat: Any,
        llama: Any,
        *,
        slots: int,
        max_len: int,
        block_schedule: tuple[int, ...],
        prefill_bucket: int,
        quantum: int = 1,
        vocoder_dtype: str = "float32",
        context_tokens: int = 16,
        holdback_tokens: int = 4,
        **options: Any,
    ) -> SlotBatch:
        """The batch for a loaded ``Chat`` whose Llama (``llama``, already in its dtype) runs the steps.

        ``quantum``: token steps between two host reads (:class:`.rows.SlotLayout`).
        ``vocoder_dtype``: the Decoder's and Vocos backbone's option (:func:`.vocode.vocoder_dtype`;
        they are converted in place).
        ``context_tokens``, ``holdback_tokens``: the rows' decode windows (:class:`.decode.StreamDecoder`),
        which size the decode ring.
        ``options``: the constructor's keyword arguments but the weights, ``speaker_token``,
        ``vocoder`` and ``ring_tokens``.
        """
        cfg, embed = llama.config, chat.embed
        heads, hidden = int(cfg.num_attention_heads), int(cfg.hidden_size)
        layout = SlotLayout(
            layers=int(cfg.num_hidden_layers),
            kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or hidden // heads),
            hidden_size=hidden,
            num_vq=int(embed.num_vq),
            slots=slots,
            max_len=max_len,
            block_schedule=block_schedule,
            eos=int(embed.num_audio_tokens) - 1,
            prefill_bucket=prefill_bucket,
            quantum=quantum,
        )
        with torch.inference_mode():
            # Stacked once: weight_norm would recompute each head's weight on every call.
            head_w = torch.stack([h.weight.detach().float() for h in embed.head_code]).contiguous()
            code_w = torch.stack([e.weight.detach().float() for e in embed.emb_code]).contiguous()
            text_w = embed.emb_text.weight.detach()
        # One decode call for every due row on CUDA; on the CPU, rows of similar window lengths.
        cuda = options["device"].type == "cuda"
        waste = None if cuda else 0.25
        dtype = vocoder_dtype_of(vocoder_dtype, options["dtype"])
        vocoder = BatchVocoder(chat.decoder, chat.vocos, max_waste=waste, dtype=dtype)
        ring = ring_tokens_for(
            context_tokens=context_tokens, holdback_tokens=holdback_tokens, block_schedule=block_schedule
        )
        weights = {"head_w": head_w, "code_w": code_w, "text_w": text_w}
        speaker = int(chat.tokenizer.spk_emb_ids)
        return cls(
            llama, layout, **weights, speaker_token=speaker, vocoder=vocoder, ring_tokens=ring, **options
        )

    def prefill_length(self, prompt_tokens: int) -> int:
        """The padded length a prompt of ``prompt_tokens`` tokens is prefilled at (its bucket)."""
        return self.prefiller.length(prompt_tokens)

    def prefill(self, rows: list[Row]) -> None:
        """Run newcomers' prompts into free slots: grouped by bucket, a few batched calls (:mod:`.prefill`).

        Padded because every distinct prefill length costs the CPU kernels (oneDNN primitives,
        allocator pools) memory that is never given back: one shape per prompt length made RSS
        climb by about 2 MiB per new length (``bench/results/studies/rss-shapes-epyc-2core.md``).
        """
        self.prefiller.run(rows)

    def warm_prefill(self, longest_prompt: int) -> None:
        """Prefill once at every (rows, bucket length) up to ``longest_prompt``'s, in borrowed slots."""
        self.prefiller.prepare(longest_prompt)

    def release(self, row: Row) -> None:
        """Free the row's slot (no other slot is touched) and its KV memory.

        The freed slot's length goes back to 0: a step over ``[0, b)`` writes every row at its
        length, and a freed row should touch only its first page, not one deep in its old stream.
        """
        if row.slot >= 0:
            self.kv.give_back(row.slot)
            self.state.lengths[row.slot] = 0
            self.ring.reset(row.slot)
            row.slot = -1

    def run(
        self, rows: list[Row], token_tap: TokenTap | None = None, interrupt: Interrupt | None = None
    ) -> list[StepResult]:
        """One block for prefilled ``rows`` (:meth:`.block.BlockLoop.run`); ended rows are not released.

        The block runs in quanta of ``layout.quantum`` token steps, each read once by the host.
        ``interrupt`` returning True after a quantum ends the block after the quantum in flight,
        so that a newcomer (or a cancel) waits a quantum or two, not a whole block.
        """
        return self.block.run(self.runner, rows, token_tap, interrupt)
