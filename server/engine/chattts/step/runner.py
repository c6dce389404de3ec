"""One engine step over KV-slot rows: prefill into slots, the block of quanta, batched decode.

:class:`SlotBatch` owns the static machinery (KV slots, slot state, token
step and its runner, batched vocoder) and runs one block for the rows it is
given (newcomers are prefilled first, together: :mod:`.prefill`):

1. ``begin_block`` marks the rows' slots as stepping (one small upload);
2. the block is a whole number of quanta: a quantum is ``K`` token steps
   (``runner.run(batch, length)``, a CUDA graph replay on a GPU) enqueued back to
   back, with no read in between (a row that ends stops producing on the device);
3. after each quantum, ONE read of the rows' ``produced``/``stepping``/``lengths``
   (:mod:`.summary`): the block stops when no row steps, or when the core's
   ``interrupt`` says a command waits; never inside a quantum;
4. every row whose own block schedule says it is due (or that ended) plans its
   decode window, and all windows go through one batched Decoder + Vocos call.

A row decodes every ``block_schedule[k]`` tokens of its own, whatever the
other rows do: the block a step runs is the fewest tokens any row needs to
reach its next decode, so a newcomer's short first block no longer makes
every other row decode (and re-decode context) after 8 tokens. The schedule's
blocks are multiples of ``K``, so quanta leave every decode window as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from server.engine.chattts.decode import DecodeWindow
from server.engine.chattts.step import decode_attention
from server.engine.chattts.step.compiled import CompiledRunner
from server.engine.chattts.step.graphs import CudaGraphRunner, EagerRunner, StepFn, StepRunner
from server.engine.chattts.step.kv import (
    LENGTH_STEP,
    SlotKV,
    batch_buckets,
    bucket_for,
    kv_dtype,
    length_buckets,
)
from server.engine.chattts.step.prefill import Prefill
from server.engine.chattts.step.rows import Row, SlotLayout
from server.engine.chattts.step.summary import BlockSummary, SummaryReader, upload
from server.engine.chattts.step.token_step import SlotState, TokenStep
from server.engine.chattts.vocode import BatchVocoder
from server.engine.chattts.vocode import vocoder_dtype as vocoder_dtype_of
from server.engine_api import StepResult

__all__ = ["Interrupt", "Row", "RunnerFactory", "SlotBatch", "SlotLayout", "TokenTap"]

log = logging.getLogger(__name__)

#: ``(seq_id, codes (k, num_vq) long, hiddens (k, hidden) float32)`` of the k audio tokens a
#: sequence accepted in one step (EOS excluded), on the CPU. Tests compare them with ChatTTS's own.
TokenTap = Callable[[int, torch.Tensor, torch.Tensor], None]
#: Builds the step runner around the static step (tests pass a recording one).
RunnerFactory = Callable[[StepFn], StepRunner]
#: Asked after each quantum of a block but its last: True ends the block at that quantum boundary.
Interrupt = Callable[[], bool]


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
            max_len=layout.max_len,
            head_dim=layout.head_dim,
            dtype=kv_dtype(dtype, device, compiled=compiled),
            device=device,
        )
        self.state = SlotState.allocate(
            slots=layout.slots,
            hidden_size=layout.hidden_size,
            num_vq=layout.num_vq,
            block=max(layout.block_schedule),
            max_len=layout.max_len,
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
        """Prepare the runner at every shape; if a capturing runner fails, step eagerly instead.

        A GPU user must never be stopped by code that has not run on their GPU before:
        the failure is logged once, loudly, and stated in the engine's info (``hello``,
        ``/metrics``). The eager step failing too is a real fault and raises.
        """
        try:
            self.runner.prepare(shapes)
        except Exception as exc:
            if isinstance(self.runner, EagerRunner):
                raise
            cause = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
            self.runner_fallback = f"{self.runner.kind} failed at warm-up: {cause}"
            log.error(
                "TOKEN STEP FALLBACK: %s; running the token step eagerly (slower)", self.runner_fallback
            )
            self.runner = EagerRunner(self.token_step)
            self.runner.prepare(shapes)
        self.runner_prepared = True

    def describe(self) -> dict[str, str]:
        """KV slots, memory and shape buckets, for the engine's info and the start-up log."""
        facts = {
            "kv_slots": str(self.layout.slots),
            "kv_max_len": str(self.layout.max_len),
            "kv_cache_bytes": str(self.kv.nbytes),
            "token_step": self.runner.kind,
            "quantum_tokens": str(self.layout.quantum),
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
        **options: Any,
    ) -> SlotBatch:
        """The batch for a loaded ``Chat`` whose Llama (``llama``, already in its dtype) runs the steps.

        ``quantum``: token steps between two host reads (:class:`.rows.SlotLayout`).
        ``vocoder_dtype``: the Decoder's and Vocos backbone's option (:func:`.vocode.vocoder_dtype`;
        they are converted in place).
        ``options``: the constructor's keyword arguments but the weights, ``speaker_token`` and ``vocoder``.
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
        weights = {"head_w": head_w, "code_w": code_w, "text_w": text_w}
        speaker = int(chat.tokenizer.spk_emb_ids)
        return cls(llama, layout, **weights, speaker_token=speaker, vocoder=vocoder, **options)

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
            row.slot = -1

    def _target(self, row: Row) -> int:
        schedule = self.layout.block_schedule
        return schedule[min(row.decodes, len(schedule) - 1)]

    def run(
        self, rows: list[Row], token_tap: TokenTap | None = None, interrupt: Interrupt | None = None
    ) -> list[StepResult]:
        """One block for prefilled ``rows``; a row that ended is reported ``finished`` (and not released).

        The block runs in quanta of ``layout.quantum`` token steps, each followed by the one host
        read of the summary. ``interrupt`` returning True after a quantum ends the block there, so
        that a newcomer (or a cancel) waits one quantum, not a whole block; it never cuts a
        quantum short. A row decodes only at its own schedule's targets, so an early end changes
        neither tokens nor audio: the rest of its block is the next one.
        """
        quantum = self.layout.quantum
        block = min(self._target(r) - r.undecoded for r in rows)
        quanta = max(1, -(-block // quantum))  # whole: the schedule's blocks are multiples of the quantum
        batch = bucket_for(self.batch_buckets, max(r.slot for r in rows) + 1)
        self.state.begin_block([r.slot for r in rows])
        longest, t = max(r.length for r in rows), 0
        for q in range(quanta):
            for _ in range(quantum):  # enqueued back to back: no read inside a quantum
                t += 1
                self.runner.run(batch, bucket_for(self.length_buckets, min(longest + t, self.layout.max_len)))
            summary = self._read(batch)  # the one device→host read per quantum
            if not summary.any_alive or (interrupt is not None and q + 1 < quanta and interrupt()):
                break
        return self._end_block(rows, batch, summary, token_tap)

    def _read(self, batch: int) -> BlockSummary:
        st = self.state
        return self.summaries.read(batch, st.produced, st.stepping, st.lengths)

    def _end_block(
        self, rows: list[Row], batch: int, summary: BlockSummary, token_tap: TokenTap | None
    ) -> list[StepResult]:
        """Hand each row its tokens' states (one gather for all); decode every row that is due in one call."""
        st, produced, alive = self.state, summary.produced, summary.alive
        for slot, length in enumerate(summary.lengths):  # every row of [0, batch) wrote at its length
            self.kv.cover(slot, length + 1)
        for row, hiddens in self._gather(rows, batch, produced):
            row.decoder.push(hiddens)
            if token_tap is not None:  # copies: the buffers are reused by the next block
                codes = st.pending_codes[row.slot, : len(hiddens)].to("cpu", copy=True)
                token_tap(row.request.seq_id, codes, hiddens.to("cpu", copy=True))
        due: list[tuple[Row, bool]] = []
        for row in rows:
            row.length = summary.lengths[row.slot]
            row.undecoded += produced[row.slot]
            finished = not alive[row.slot]
            if finished or row.undecoded >= self._target(row):
                row.decodes += 1
                row.undecoded = 0
                due.append((row, finished))
        audio = self._decode(due)
        empty = np.zeros(0, dtype=np.float32)
        return [
            StepResult(
                seq_id=row.request.seq_id,
                audio=audio.get(row.request.seq_id, empty),
                tokens=produced[row.slot],
                finished=not alive[row.slot],
            )
            for row in rows
        ]

    def _gather(self, rows: list[Row], batch: int, produced: list[int]) -> list[tuple[Row, torch.Tensor]]:
        """Each row that produced tokens with a copy of their states, all gathered in one device op.

        One gather rather than a copy per row: the work between quanta must not grow with the
        rows. The copy holds exactly the block's produced tokens (the buffers are reused by the
        next block); each row keeps its part until it decodes.
        """
        made = [(row, produced[row.slot]) for row in rows if produced[row.slot]]
        if not made:
            return []
        pending = self.state.pending_hidden
        block = int(pending.shape[1])
        index = upload([row.slot * block + i for row, k in made for i in range(k)], pending.device)
        states = pending[:batch].flatten(0, 1).index_select(0, index)
        parts = torch.split(states, [k for _, k in made])
        return [(row, part) for (row, _), part in zip(made, parts, strict=True)]

    def _decode(self, due: list[tuple[Row, bool]]) -> dict[int, npt.NDArray[np.float32]]:
        """The decode stage: each due row plans its window, all go through one batched vocoder call."""
        windows: list[tuple[Row, DecodeWindow]] = []
        for row, finished in due:
            window = row.decoder.plan(final=finished)
            if window is not None:
                windows.append((row, window))
        if not windows:
            return {}
        wavs = self.vocoder.decode([w.hiddens for _, w in windows])
        done = zip(windows, wavs, strict=True)
        return {row.request.seq_id: row.decoder.finish(window, wav) for (row, window), wav in done}
