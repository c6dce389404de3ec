"""The ChatTTS engine: the project's own token-block generation loop over ChatTTS's modules.

ChatTTS's ``infer(stream=True)`` is unfit for serving (first audio after ~72
tokens, quadratic re-decode with seams, one cursor and one interrupt flag for
a whole batch), so this engine uses only ChatTTS's loaded modules (Llama,
embeddings, heads, tokenizer, speaker statistics, Decoder, Vocos) and runs:

* prefill inside :meth:`ChatTTSEngine.step`, a step's newcomers together, each into its own KV slot
  (:mod:`.step.prefill`, :mod:`.step.kv`);
* blocks of token steps (:mod:`.step.runner`) over the slots (:mod:`.step.token_step`, the Llama
  in :mod:`.step.llama` on the projections of :mod:`.step.linear`), eagerly, as CUDA graphs
  (:mod:`.step.graphs`) or compiled on the CPU (:mod:`.step.compiled`), sampling on the device
  (:mod:`.step.sampling`), in quanta of ``quantum_tokens`` steps: one host read per quantum;
* incremental decode of only the new tokens, each row on its own block schedule, all rows due
  in one batched Decoder + Vocos call (on the CPU, one per group of similar window lengths,
  in bf16 with a bf16 GPT) (:mod:`.decode`, :mod:`.vocode`). Only ``server/engine/chattts/`` imports torch.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from server.engine.chattts.assets import LoadedChat, ModelUnavailableError, Verify, load_chat
from server.engine.chattts.decode import StreamDecoder, make_decode_fn
from server.engine.chattts.options import EngineOptions
from server.engine.chattts.prompt import PromptBuilder
from server.engine.chattts.refine import RefineParams, Refiner, RefineRow, TextRefiner
from server.engine.chattts.refine_queue import RefineQueue
from server.engine.chattts.setup import engine_info, kv_shape, log_engine_info, resolve_device, resolve_dtype
from server.engine.chattts.step.compiled import use_compile_cache
from server.engine.chattts.step.linear import prepare_projections
from server.engine.chattts.step.runner import Interrupt, Row, RunnerFactory, SlotBatch, TokenTap
from server.engine.chattts.step.sampling import seed_of, stream_key
from server.engine.chattts.textside import TextSide
from server.engine_api import (
    AudioArray,
    Codes,
    EngineError,
    EngineInfo,
    EngineOutOfMemory,
    SequenceRequest,
    StepResult,
    SynthesisParams,
)

__all__ = ["ChatTTSEngine", "ModelUnavailableError", "resolve_device", "resolve_dtype"]

log = logging.getLogger(__name__)
_WARMUP_ID = -(1 << 62)
_NO_AUDIO = np.zeros(0, np.float32)
_DEFAULT_OPTIONS = EngineOptions()
_DECODE_OPTIONS = ("context_tokens", "holdback_tokens", "crossfade_samples")  # StreamDecoder's, as named


class ChatTTSEngine:
    """ChatTTS behind the :class:`server.engine_api.Engine` protocol.

    Build it with :meth:`load`. All methods run on the scheduler's one inference thread.
    Options: :class:`server.engine.chattts.options.EngineOptions`.
    """

    def __init__(
        self,
        loaded: LoadedChat,
        *,
        device: torch.device,
        dtype: torch.dtype,
        options: EngineOptions = _DEFAULT_OPTIONS,
        step_runner: RunnerFactory | None = None,
    ) -> None:
        self.options = options  # what it was built with
        self.block_schedule, self.prefill_bucket = options.block_schedule, options.prefill_bucket
        chat = self._chat = loaded.chat
        self._loaded, self.device, self.dtype = loaded, device, dtype
        self.min_tokens = max(1, options.min_tokens)  # ChatTTS never returns an empty sequence
        self.warmup_prompt_chars = options.warmup_prompt_chars
        self._decode_opts = {name: getattr(options, name) for name in _DECODE_OPTIONS}
        self._llama = chat.gpt.gpt
        self._projections = prepare_projections(
            self._llama, dtype=dtype, device=device, quantize=options.quantize, compiled=options.compile_step
        )
        cfg = self._llama.config
        self.hidden_size = int(cfg.hidden_size)
        self._decode_fn = make_decode_fn(chat.decoder, chat.vocos)
        # What a front end with the engine in another process loads on its own (load_text_side).
        self.text_side = TextSide(chat, dim=self.hidden_size, options=options)
        self.voices, self.text = self.text_side.voices, self.text_side.text
        # Prompt ids stay on the host: the prefill stages a step's newcomers there and uploads them once.
        self.prompts = PromptBuilder(chat, self.text, self.voices, self.text_side.limits, torch.device("cpu"))
        #: The refinement pass (``refine: true``); tests put a fixed stand-in here.
        self.refiner: Refiner = TextRefiner(chat, device=device)
        #: Its sampling (ChatTTS's ``RefineTextParams`` defaults) and token cap.
        self.refine_params = RefineParams(max_new_tokens=self.prompts.limits.refine_tokens)
        # One refinement block per step, as long as the longest speech block: see RefineQueue.
        self._refining = RefineQueue(block_tokens=max(self.block_schedule))
        self.segment_max_tokens = options.segment_max_tokens
        self.longest_prompt = self.prompts.longest()
        self.max_len, self.slots = kv_shape(options, cfg, self.longest_prompt, device=device, dtype=dtype)
        self._batch = SlotBatch.for_chat(
            chat,
            self._llama,
            slots=self.slots,
            max_len=self.max_len,
            block_schedule=self.block_schedule,
            prefill_bucket=self.prefill_bucket,
            prefill_tokens=options.prefill_tokens,
            quantum=options.quantum_for(device.type),
            overlap=options.overlap_for(device.type),
            context_tokens=options.context_tokens,
            holdback_tokens=options.holdback_tokens,
            dtype=dtype,
            device=device,
            min_tokens=self.min_tokens,
            repetition_penalty=options.repetition_penalty,
            cuda_graphs=options.cuda_graphs,
            compile_step=options.compile_step,
            step_runner=step_runner,
            vocoder_dtype=options.vocoder_dtype,
        )
        use_compile_cache(self._batch.runner, options, loaded.model_dir, dtype)
        self.num_vq, self.eos = self._batch.layout.num_vq, self._batch.layout.eos
        self._prepared = False
        self._seqs: dict[int, Row] = {}
        #: Called with every sequence's accepted tokens after each step (``None``: off; tests set it).
        self.token_tap: TokenTap | None = None
        #: Asked after each quantum: True ends the block there (the core's "a command waits"; None: off).
        self.interrupt: Interrupt | None = None
        self._info = self._describe()

    @classmethod
    def load(
        cls,
        *,
        model_dir: Path | str | None = None,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        num_threads: int | None = None,
        cache_dir: Path | None = None,
        download_timeout_s: float = 5.0,
        verify_weights: Verify = "official",
        options: EngineOptions = _DEFAULT_OPTIONS,
        step_runner: RunnerFactory | None = None,
    ) -> ChatTTSEngine:
        """Load the weights and build the engine.

        Args:
            model_dir: folder with ChatTTS's ``asset/`` layout (official or dev model);
                ``None`` = official weights from the hub cache, downloaded once.
            device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
            dtype: the Llama's dtype: ``"auto"`` (bf16 where native, else float32 on CPU, fp16 on GPU),
                ``"float32"``, ``"bfloat16"``, ``"float16"``; the vocoder follows bf16 (``vocoder_dtype``).
            num_threads: ``torch.set_num_threads`` (``None`` = leave torch's default).
            cache_dir: hub cache for ``model_dir=None``.
            download_timeout_s: hub timeout; offline fails within about this long.
            verify_weights: ``"official"`` (hash-checked) or ``"none"`` (fine-tuned weights,
                reported as unverified); see :func:`server.engine.chattts.assets.load_chat`.
            options: how it generates, see :class:`server.engine.chattts.options.EngineOptions`.
            step_runner: the token step's runner factory (tests record the steps with one).

        Raises:
            ModelUnavailableError: weights missing, hash mismatch, or hub unreachable.
        """
        if num_threads is not None and num_threads > 0:
            torch.set_num_threads(num_threads)
        dev = resolve_device(device)
        loaded = load_chat(
            model_dir=model_dir,
            device=dev,
            cache_dir=cache_dir,
            download_timeout_s=download_timeout_s,
            verify=verify_weights,
        )
        dt = resolve_dtype(dtype, dev)
        engine = cls(loaded, device=dev, dtype=dt, options=options, step_runner=step_runner)
        engine.prepare_step()  # before ``info`` is published: it says which token step runs
        return engine

    @property
    def info(self) -> EngineInfo:
        """Static facts about this engine."""
        return self._info

    @property
    def random_weights(self) -> bool:
        """Whether the loaded weights are a random dev model."""
        return self._loaded.random_weights

    @property
    def live_sequences(self) -> int:
        """Sequences holding state, refining ones included (tests assert that work is freed)."""
        return len(self._seqs) + len(self._refining)

    @property
    def free_slots(self) -> int:
        """KV slots no sequence holds."""
        return self._batch.kv.free_slots

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes reserved for the KV slots: the most they can hold (known from start-up; a metric)."""
        return self._batch.kv.nbytes

    def kv_resident_bytes(self) -> int:
        """Bytes of the KV slots in memory now (a metric): on the CPU, what the live rows wrote."""
        return self._batch.kv.resident_bytes

    def validate_voice(self, voice: str) -> bool:
        """``default``, ``seed:<int>`` and valid ChatTTS speaker strings are voices (any thread)."""
        return self.text_side.validate_voice(voice)

    def prompt_text(self, text: str, params: SynthesisParams) -> str:
        """The text the GPT sees: ``[Stts][spk_emb][speed_k]text[Ptts]`` (ChatTTS's code prompt).

        ``text`` is the user's segment, put through :class:`~server.engine.chattts.text.ChatTTSText`
        (our number speller, then ChatTTS's normalizer). A recording's voice:
        ``[Stts][empty_spk]{transcript}[speed_k]text[Ptts]``.
        """
        return self.prompts.code_prompt(self.text.model_text(text), params).text

    def text_tokens(self, text: str) -> int:
        """Tokens of ``text`` for the model, numbers spelled out (any thread: a tokenizer of its own)."""
        return self.text_side.text_tokens(text)

    def encode_voice(self, audio: AudioArray, transcript: str) -> Codes:
        """DVAE codes of a 24 kHz recording (``Chat.sample_audio_speaker``), checked against the limits."""
        return self.prompts.encode_voice(audio, transcript)

    def add(self, request: SequenceRequest) -> None:
        """Tokenize and register a sequence; prefilled in the next step naming it (refined first if asked)."""
        if request.seq_id in self._seqs or request.seq_id in self._refining:
            raise EngineError(f"sequence {request.seq_id} already exists")
        if self.live_sequences >= self.slots:
            raise EngineError(f"all {self.slots} KV slots are in use (--max-batch)")
        model_text = self.text.model_text(request.text)
        row = self._row(request, model_text)  # checks the voice and the length, refined or not
        if not request.params.refine:
            self._seqs[request.seq_id] = row
            return
        if not self._info.refine:
            raise EngineError("refinement is off on this server (--refine-max-tokens 0)")
        self._refining.add(request, RefineRow(model_text, request.params.refine_prompt, seed_of(request)))

    def _row(self, request: SequenceRequest, model_text: str, *, refined: bool = False) -> Row:
        """The engine's state of a sequence whose prompt reads ``model_text``."""
        prompt = self.prompts.code_prompt(model_text, request.params)
        n = int(prompt.input_ids.shape[1])
        if self.prefill_length(n) >= self.max_len:
            if refined:  # re-tokenized refinements may run longer than their tokens: speak it unrefined
                log.warning("a refined prompt of %d tokens does not fit a KV slot; spoken unrefined", n)
                return self._row(request, self.text.model_text(request.text))
            raise EngineError(f"text too long: {n} prompt tokens (a KV slot holds {self.max_len} positions)")
        return Row(
            request=request,
            input_ids=prompt.input_ids,
            text_mask=prompt.text_mask,
            speaker=prompt.speaker,
            key=stream_key(seed_of(request)),
            decoder=StreamDecoder(None, **self._decode_opts),
            max_tokens=max(1, min(request.max_tokens, self.segment_max_tokens, self.max_len - n)),
        )

    def drop(self, seq_id: int) -> None:
        """Forget a sequence and free its KV slot (no-op for unknown ids); no other row is touched."""
        self._refining.drop(seq_id)
        row = self._seqs.pop(seq_id, None)
        if row is not None:
            self._batch.release(row)

    def step(self, seq_ids: list[int]) -> list[StepResult]:
        """Advance the sequences by one token block each; ``interrupt`` may end the block early.

        New ones are prefilled first; refining ones advance their refinement (no audio), and one
        that finishes refining now is prefilled and steps at once.
        """
        unknown = [s for s in seq_ids if s not in self._seqs and s not in self._refining]
        if unknown:
            raise EngineError(f"unknown sequence ids {unknown}")
        named = list(dict.fromkeys(seq_ids))
        try:
            with torch.inference_mode():
                self._refine([s for s in named if s in self._refining])
                rows = [self._seqs[s] for s in named if s in self._seqs]
                results = self._step(rows) if rows else []
        except torch.cuda.OutOfMemoryError as exc:
            self.empty_cache()
            raise EngineOutOfMemory(f"out of accelerator memory with {len(seq_ids)} rows: {exc}") from exc
        refining = [s for s in named if s in self._refining]
        return results + [StepResult(seq_id=s, audio=_NO_AUDIO, tokens=0, finished=False) for s in refining]

    def _refine(self, seq_ids: list[int]) -> None:
        """One block of refinement for these sequences; the finished ones get their speech prompt."""
        if not seq_ids:
            return
        for request, refined in self._refining.advance(seq_ids, self.refiner, self.refine_params):
            self._seqs[request.seq_id] = self._row(request, refined, refined=True)

    def empty_cache(self) -> None:
        """Return cached accelerator memory (the scheduler calls it after an OOM)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def prefill_length(self, prompt_tokens: int) -> int:
        """The padded length a prompt of ``prompt_tokens`` tokens is prefilled at (its bucket)."""
        return self._batch.prefill_length(prompt_tokens)

    def _step(self, rows: list[Row]) -> list[StepResult]:
        newcomers = [row for row in rows if row.slot < 0]
        if newcomers:  # embedded (speaker included) and prefilled together, into free slots
            self._batch.prefill(newcomers)
        results = self._batch.run(rows, self.token_tap, self.interrupt)
        for result in results:
            if result.finished:
                self.drop(result.seq_id)
        return results

    def decode_tokens(self, hiddens: torch.Tensor) -> np.ndarray[Any, np.dtype[np.float32]]:
        """One-shot decode of ``(T, hidden)`` states on any device (a stream's reference audio)."""
        with torch.inference_mode():
            return self._decode_fn(hiddens.to(self.device))

    def step_shapes(self) -> list[tuple[int, int]]:
        """Every (batch, attention length) a token step can run at: the closed bucket set."""
        return self._batch.shapes()

    def _describe(self) -> EngineInfo:
        dev, dtype, projections = self.device, self.dtype, self._projections
        return engine_info(
            self._loaded, self._batch, device=dev, dtype=dtype, projections=projections, options=self.options
        )

    def prepare_step(self) -> None:
        """Run (CUDA: capture) the token step at every shape once; a runner that fails gives way to eager."""
        if not self._batch.runner_prepared:
            with torch.inference_mode():
                self._batch.prepare_runner(self.step_shapes())
            self._info = self._describe()
            log_engine_info(self._info, self._batch.kv.nbytes, lazy=self._batch.kv.lazy)

    def warmup(self) -> None:
        """Meet every shape serving will meet before the first request does.

        The first call prefills every (rows, prompt bucket) up to the longest expected prompt and runs
        (on CUDA: captures) the token step at every (batch, length) bucket; every call then
        runs one short sequence through every block size (allocations, kernels, numba).
        """
        if not self._prepared:
            self.prepare_step()
            with torch.inference_mode():
                # Without buckets (1) every length is its own shape: too many to warm, so none are.
                if self.prefill_bucket > 1:
                    self._batch.warm_prefill(self.longest_prompt)
                if self._info.refine:  # the refinement's own path (HF Llama with a growing cache)
                    self.refiner.start([RefineRow("warm up", seed=0)], self.refine_params).advance(4)
            self._batch.kv.trim()  # the steps above wrote into free slots: hand those pages back
            self._prepared = True
        if self.live_sequences >= self.slots:
            log.warning("warm-up skipped its test sequence: every KV slot is in use")
            return
        tokens = sum(self.block_schedule) + 1
        params = SynthesisParams(seed=0)
        request = SequenceRequest(seq_id=_WARMUP_ID, text="warm up", params=params, max_tokens=tokens)
        self.add(request)
        try:
            while _WARMUP_ID in self._seqs:
                self.step([_WARMUP_ID])
        finally:
            self.drop(_WARMUP_ID)

    def memory_allocated(self) -> int:
        """Accelerator bytes held by tensors (0 on the CPU); exported as a metric."""
        return int(torch.cuda.memory_allocated(self.device)) if self.device.type == "cuda" else 0

    def close(self) -> None:
        """Release every sequence, the KV slots, the captured graphs and the model."""
        self._seqs.clear()
        self._refining.clear()
        for name in ("gpt", "embed", "decoder", "dvae", "vocos"):
            if hasattr(self._chat, name):
                delattr(self._chat, name)
        del self._llama, self._batch
        gc.collect()
        self.empty_cache()
