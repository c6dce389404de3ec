"""The ChatTTS engine: the project's own token-block generation loop over ChatTTS's modules.

ChatTTS's ``infer(stream=True)`` is unfit for serving (first audio after ~72
tokens, quadratic re-decode with seams, one cursor and one interrupt flag for
a whole batch), so this engine uses only ChatTTS's loaded modules (Llama,
embeddings, heads, tokenizer, speaker statistics, Decoder, Vocos) and runs:

* per-sequence prefill inside :meth:`ChatTTSEngine.step`, then token blocks
  over a batch whose rows are padded KV-cache rows that join and leave
  between blocks (:mod:`server.engine.chattts_batch`);
* per-sequence random generators, EOS (code 625 on any of the 4 streams)
  and token limits;
* incremental decode of only the new tokens (:mod:`server.engine.chattts_decode`).

Only ``server/engine/chattts*.py`` import torch; this is one of them.
"""

from __future__ import annotations

import gc
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache

from server.engine.base import (
    EngineError,
    EngineInfo,
    EngineOutOfMemory,
    SequenceRequest,
    StepResult,
    SynthesisParams,
)
from server.engine.chattts_assets import LoadedChat, ModelUnavailableError, Verify, load_chat
from server.engine.chattts_batch import (
    MIN_TEMPERATURE,
    PENALTY_WINDOW,
    GrowLayer,
    RowGroup,
    RowSampling,
    concat_groups,
    empty_layers,
    push_history,
    sample_codes,
)
from server.engine.chattts_decode import SAMPLES_PER_TOKEN, StreamDecoder, make_decode_fn
from server.engine.chattts_reference import CodePrompt, code_prompt
from server.engine.chattts_text import ChatTTSText
from server.engine.chattts_voice import VoiceBank, speed_token

__all__ = ["ChatTTSEngine", "ModelUnavailableError", "resolve_device", "resolve_dtype"]

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WARMUP_ID = -(1 << 62)

#: ``(seq_id, codes (k, num_vq) long, hiddens (k, hidden) float32)`` of the k audio tokens a
#: sequence accepted in one step (EOS excluded), on the CPU: what native ``infer`` calls ``ids``
#: and ``hiddens``. Tests compare them with ChatTTS's own generation (tests/model/test_native_equivalence.py).
TokenTap = Callable[[int, torch.Tensor, torch.Tensor], None]


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` → CUDA when available, else CPU; anything else as given."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The Llama's dtype. ``"auto"``: float32 on the CPU, bf16 on GPUs that have it, else fp16.

    float32 keeps the engine token-identical to ChatTTS's own ``infer()``. On this project's
    2-core CPU bfloat16 was no faster at batch 1 (0.7-1.2x) and 1.5-2x faster at batch 4, and
    it changed the sampled tokens within 0-11 steps (``bench/results/dtype_cpu.md``; CPUs without
    native bf16 are slower still). On GPUs throughput is the point (not measured here).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            return torch.float16
        return torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; not {dtype!r}")
    return _DTYPES[dtype]


@dataclass
class _Seq:
    request: SequenceRequest
    input_ids: torch.Tensor
    text_mask: torch.Tensor
    speaker: torch.Tensor | None  # None: a voice from a recording ([empty_spk] + its codes)
    generator: torch.Generator
    decoder: StreamDecoder
    max_tokens: int
    tokens: int = 0
    blocks: int = 0
    prefilled: bool = False
    finished: bool = False


class ChatTTSEngine:
    """ChatTTS behind the :class:`server.engine.base.Engine` protocol.

    Build it with :meth:`load`. All methods run on the scheduler's one inference thread.
    """

    def __init__(
        self,
        loaded: LoadedChat,
        *,
        device: torch.device,
        dtype: torch.dtype,
        block_schedule: Sequence[int] = (8, 16, 32),
        default_voice: str = "seed:2",
        context_tokens: int = 16,
        holdback_tokens: int = 4,
        crossfade_samples: int = 256,
        min_tokens: int = 1,
        repetition_penalty: float = 1.05,
        prefill_bucket: int = 16,
        warmup_prompt_chars: int = 120,
    ) -> None:
        if not block_schedule or min(block_schedule) < 1:
            raise ValueError("block_schedule needs at least one positive block size")
        if prefill_bucket < 1:
            raise ValueError("prefill_bucket must be at least 1 (1: no padding)")
        chat = loaded.chat
        self._loaded = loaded
        self._chat = chat
        self.device = device
        self.dtype = dtype
        self.block_schedule = tuple(int(b) for b in block_schedule)
        self.min_tokens = max(1, min_tokens)  # ChatTTS also never returns an empty sequence
        self.repetition_penalty = repetition_penalty
        self.prefill_bucket = prefill_bucket
        self.warmup_prompt_chars = warmup_prompt_chars
        self._decode_opts = {
            "context_tokens": context_tokens,
            "holdback_tokens": holdback_tokens,
            "crossfade_samples": crossfade_samples,
        }
        self._llama = chat.gpt.gpt.to(dtype=dtype)
        cfg = self._llama.config
        self._n_layers = int(cfg.num_hidden_layers)
        self._kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self._head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self._max_positions = int(cfg.max_position_embeddings)
        self.hidden_size = int(cfg.hidden_size)
        embed = chat.embed
        self.num_vq = int(embed.num_vq)
        self.eos = int(embed.num_audio_tokens) - 1
        with torch.inference_mode():
            # Stacked once: weight_norm would recompute each head's weight on every call.
            self._head_w = torch.stack([h.weight.detach().float() for h in embed.head_code]).contiguous()
            self._code_w = torch.stack([e.weight.detach().float() for e in embed.emb_code]).contiguous()
        self._decode_fn = make_decode_fn(chat.decoder, chat.vocos)
        self.voices = VoiceBank(chat.speaker, self.hidden_size, default_voice=default_voice)
        self.text = ChatTTSText(chat.normalizer)
        self._seqs: dict[int, _Seq] = {}
        self._groups: list[RowGroup] = []
        #: Called with every sequence's accepted tokens after each step (``None``: off; tests set it).
        self.token_tap: TokenTap | None = None
        extra = {
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "model_dir": str(loaded.model_dir),
            "random_weights": "true" if loaded.random_weights else "false",
            "weights": loaded.weights,
        }
        self._info = EngineInfo(
            name="chattts", voices=("default",), samples_per_token=SAMPLES_PER_TOKEN, extra=extra
        )
        if loaded.random_weights:
            log.warning(
                "SERVING RANDOM WEIGHTS: %s is a dev model (DEV_MODEL.json); the audio is noise, not speech",
                loaded.model_dir,
            )

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
        block_schedule: Sequence[int] = (8, 16, 32),
        default_voice: str = "seed:2",
        context_tokens: int = 16,
        holdback_tokens: int = 4,
        crossfade_samples: int = 256,
        min_tokens: int = 1,
        prefill_bucket: int = 16,
        warmup_prompt_chars: int = 120,
    ) -> ChatTTSEngine:
        """Load the weights and build the engine.

        Args:
            model_dir: folder with ChatTTS's ``asset/`` layout (official or dev model);
                ``None`` = official weights from the hub cache, downloaded once.
            device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
            dtype: the Llama's dtype: ``"auto"`` (float32 on CPU, bf16/fp16 on GPU),
                ``"float32"``, ``"bfloat16"``, ``"float16"``. Decoder and vocoder stay float32.
            num_threads: ``torch.set_num_threads`` (``None`` = leave torch's default).
            cache_dir: hub cache for ``model_dir=None``.
            download_timeout_s: hub timeout; offline fails within about this long.
            verify_weights: ``"official"`` (hash-checked) or ``"none"`` (fine-tuned weights,
                reported as unverified); see :func:`server.engine.chattts_assets.load_chat`.
            block_schedule: tokens per block for a sequence's 1st, 2nd, ... block (last repeats).
            default_voice: what voice ``"default"`` is (``seed:N`` or a speaker string).
            context_tokens: decode left context, tokens (see :mod:`server.engine.chattts_decode`).
            holdback_tokens: audio held back at the right edge until more tokens exist.
            crossfade_samples: crossfade between consecutive decode windows.
            min_tokens: EOS is banned before this many tokens (benchmarks force lengths with it).
            prefill_bucket: prompts are padded up to a multiple of this many tokens, so the
                kernels see a few prefill shapes instead of one per prompt length (1: no padding).
            warmup_prompt_chars: :meth:`warmup` prefills every bucket up to a prompt this long.

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
        return cls(
            loaded,
            device=dev,
            dtype=resolve_dtype(dtype, dev),
            block_schedule=block_schedule,
            default_voice=default_voice,
            context_tokens=context_tokens,
            holdback_tokens=holdback_tokens,
            crossfade_samples=crossfade_samples,
            min_tokens=min_tokens,
            prefill_bucket=prefill_bucket,
            warmup_prompt_chars=warmup_prompt_chars,
        )

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
        """Sequences holding state (tests assert that work is freed)."""
        return len(self._seqs)

    def validate_voice(self, voice: str) -> bool:
        """``default``, ``seed:<int>`` and valid ChatTTS speaker strings are voices."""
        return self.voices.resolve(voice) is not None

    def prompt_text(self, text: str, params: SynthesisParams) -> str:
        """The text the GPT sees: ``[Stts][spk_emb][speed_k]text[Ptts]`` (ChatTTS's code prompt).

        ``text`` is the user's segment; it goes through :class:`ChatTTSText` (our number
        speller, then ChatTTS's own normalizer) first. A voice from a recording reads
        ``[Stts][empty_spk]{transcript}[speed_k]text[Ptts]`` (:mod:`server.engine.chattts_reference`).
        """
        return self._code_prompt(text, params).text

    def _code_prompt(self, text: str, params: SynthesisParams) -> CodePrompt:
        voice = self.voices.resolve(params.voice)
        if voice is None:
            raise EngineError(f"unknown voice {params.voice!r}")
        speed = speed_token(params.speed)
        return code_prompt(self._chat, self.text.model_text(text), speed, voice, device=self.device)

    def add(self, request: SequenceRequest) -> None:
        """Tokenize and register a sequence; its prefill runs inside the next step that names it."""
        if request.seq_id in self._seqs:
            raise EngineError(f"sequence {request.seq_id} already exists")
        prompt = self._code_prompt(request.text, request.params)
        input_ids, text_mask = prompt.input_ids, prompt.text_mask
        room = self._max_positions - int(input_ids.shape[1]) - 1
        if room < 1:
            raise EngineError(f"text too long: {input_ids.shape[1]} prompt tokens")
        seed = request.params.seed
        gen = torch.Generator(device="cpu")
        gen.manual_seed(
            (seed + request.seed_offset) % (1 << 63) if seed is not None else secrets.randbits(63)
        )
        self._seqs[request.seq_id] = _Seq(
            request=request,
            input_ids=input_ids,
            text_mask=text_mask,
            speaker=prompt.speaker,
            generator=gen,
            decoder=StreamDecoder(self._decode_fn, **self._decode_opts),
            max_tokens=max(1, min(request.max_tokens, room)),
        )

    def drop(self, seq_id: int) -> None:
        """Forget a sequence and free its KV rows (no-op for unknown ids)."""
        if self._seqs.pop(seq_id, None) is None:
            return
        self._remove_rows({seq_id})

    def _remove_rows(self, gone: set[int]) -> None:
        groups = []
        for g in self._groups:
            keep = [s for s in g.ids if s not in gone]
            if len(keep) == len(g.ids):
                groups.append(g)
            elif keep:
                groups.append(g.select(keep))
        self._groups = groups

    def step(self, seq_ids: list[int]) -> list[StepResult]:
        """Advance the given sequences by one token block each (prefilling new ones first)."""
        unknown = [s for s in seq_ids if s not in self._seqs]
        if unknown:
            raise EngineError(f"unknown sequence ids {unknown}")
        if not seq_ids:
            return []
        try:
            with torch.inference_mode():
                return self._step(list(dict.fromkeys(seq_ids)))
        except torch.cuda.OutOfMemoryError as exc:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise EngineOutOfMemory(f"out of accelerator memory with {len(seq_ids)} rows: {exc}") from exc

    def prefill_length(self, prompt_tokens: int) -> int:
        """The padded length a prompt of ``prompt_tokens`` tokens is prefilled at (its bucket).

        Never past the last position; never shorter than the prompt itself.
        """
        bucket = self.prefill_bucket
        return max(prompt_tokens, min(-(-prompt_tokens // bucket) * bucket, self._max_positions - 1))

    def _prefill(self, seq: _Seq) -> RowGroup:
        ids, mask = seq.input_ids, seq.text_mask
        emb = self._chat.embed(ids, mask)
        if seq.speaker is not None:
            self._chat.speaker.apply(emb, seq.speaker, ids, self._chat.tokenizer.spk_emb_ids, self.device)
        layers, hidden = self._prefill_padded(emb)
        seq.prefilled = True
        return RowGroup(
            ids=[seq.request.seq_id],
            layers=layers,
            pads=torch.zeros(1, dtype=torch.long, device=self.device),
            hidden=hidden,
            history=torch.full((1, self.num_vq, PENALTY_WINDOW), self.eos + 1, device=self.device),
        )

    def _prefill_padded(self, emb: torch.Tensor) -> tuple[list[GrowLayer], torch.Tensor]:
        """Prefill ``(1, n, hidden)`` embeddings at their bucket's length; the KV cache keeps ``n``.

        Every distinct prefill length costs the CPU kernels (oneDNN primitives, allocator pools)
        memory that is never given back: one shape per prompt length made RSS climb by about
        2 MiB per new length (120 lengths: +236 MiB on the tiny model,
        ``bench/results/rss_shapes_tiny_cpu.md``). Padding on the *right* needs no attention
        mask: attention is causal, so the real positions never see the pad, and the pad's cache
        entries are cut off before the first generated token overwrites them.
        """
        n = int(emb.shape[1])
        length = self.prefill_length(n)
        if length > n:
            emb = torch.cat([emb, emb.new_zeros((1, length - n, emb.shape[2]))], dim=1)
        layers = empty_layers(
            self._n_layers,
            1,
            self._kv_heads,
            self._head_dim,
            length + self.block_schedule[0] + 8,
            self.dtype,
            self.device,
        )
        out = self._llama(
            inputs_embeds=emb.to(self.dtype),
            position_ids=torch.arange(length, device=self.device).unsqueeze(0),
            past_key_values=Cache(layers=list(layers)),
            use_cache=True,
            cache_position=torch.arange(length, device=self.device),
        )
        for layer in layers:
            layer.truncate(n)
        return layers, out.last_hidden_state[:, n - 1].float()

    def _assemble(self, ids: list[int]) -> RowGroup:
        """One group holding exactly ``ids``; other rows stay parked in their groups."""
        wanted = set(ids)
        taken: list[RowGroup] = []
        parked: list[RowGroup] = []
        for g in self._groups:
            inside = [s for s in g.ids if s in wanted]
            if len(inside) == len(g.ids):
                taken.append(g)
            elif not inside:
                parked.append(g)
            else:
                taken.append(g.select(inside))
                parked.append(g.select([s for s in g.ids if s not in wanted]))
        fresh = [self._prefill(self._seqs[s]) for s in ids if not self._seqs[s].prefilled]
        active = concat_groups(taken + fresh, headroom=max(self.block_schedule) + 1)
        self._groups = [*parked, active]
        return active

    def _sampling(self, rows: list[_Seq]) -> RowSampling:
        p = [s.request.params for s in rows]
        dev = self.device
        return RowSampling(
            temperature=torch.tensor([max(MIN_TEMPERATURE, x.temperature) for x in p], device=dev),
            top_p=torch.tensor([min(1.0, max(0.0, x.top_p)) for x in p], device=dev),
            top_k=torch.tensor([max(1, x.top_k) for x in p], device=dev, dtype=torch.long),
            suppress_eos=torch.tensor([s.tokens < self.min_tokens for s in rows], device=dev),
        )

    def _step(self, ids: list[int]) -> list[StepResult]:
        group = self._assemble(ids)
        rows = [self._seqs[s] for s in group.ids]
        block = min(self.block_schedule[min(s.blocks, len(self.block_schedule) - 1)] for s in rows)
        produced = [0] * len(rows)
        pending: list[list[torch.Tensor]] = [[] for _ in rows]
        pending_codes: list[list[torch.Tensor]] = [[] for _ in rows]
        for _ in range(block):
            if all(s.finished for s in rows):
                break
            logits = torch.einsum("bh,qvh->bqv", group.hidden, self._head_w)
            uniforms = torch.stack([torch.rand(self.num_vq, generator=s.generator) for s in rows]).to(
                self.device
            )
            codes = sample_codes(
                logits,
                group.history,
                self._sampling(rows),
                uniforms,
                eos=self.eos,
                repetition_penalty=self.repetition_penalty,
            )
            codes_cpu = codes.cpu()
            ended = codes_cpu.eq(self.eos).any(dim=1).tolist()
            keep = [not s.finished and not e for s, e in zip(rows, ended, strict=True)]
            alive = [k and s.tokens + 1 < s.max_tokens for s, k in zip(rows, keep, strict=True)]
            new_hidden = self._forward_codes(group, codes) if any(alive) else group.hidden
            # Commit only after the forward succeeded, so an OOM leaves every row consistent.
            for i, s in enumerate(rows):
                if s.finished:
                    continue
                if keep[i]:
                    pending[i].append(group.hidden[i : i + 1])
                    pending_codes[i].append(codes_cpu[i])
                    s.tokens += 1
                    produced[i] += 1
                s.finished = not alive[i]
            group.history = push_history(group.history, codes)
            group.hidden = new_hidden
        results = []
        for i, s in enumerate(rows):
            s.blocks += 1
            if pending[i]:
                s.decoder.push(torch.cat(pending[i]))
                if self.token_tap is not None:
                    codes_i, hidden_i = torch.stack(pending_codes[i]), torch.cat(pending[i]).cpu()
                    self.token_tap(s.request.seq_id, codes_i, hidden_i)
            audio = s.decoder.pull(final=s.finished)
            results.append(
                StepResult(seq_id=s.request.seq_id, audio=audio, tokens=produced[i], finished=s.finished)
            )
        done = {s.request.seq_id for s in rows if s.finished}
        for seq_id in done:
            del self._seqs[seq_id]
        if done:
            self._remove_rows(done)
        return results

    def _forward_codes(self, group: RowGroup, codes: torch.Tensor) -> torch.Tensor:
        """Feed one code vector per row; returns the new last hidden states (float32)."""
        emb = self._code_w[torch.arange(self.num_vq, device=self.device), codes].sum(dim=1)
        before = group.length
        try:
            out = self._llama(
                inputs_embeds=emb.unsqueeze(1).to(self.dtype),
                attention_mask=group.attention_mask(1),
                position_ids=group.positions(1),
                past_key_values=group.cache(),
                use_cache=True,
                cache_position=torch.arange(before, before + 1, device=self.device),
            )
        except BaseException:
            for layer in group.layers:  # undo partial appends of a failed forward
                layer.truncate(before)
            raise
        hidden: torch.Tensor = out.last_hidden_state[:, -1].float()
        return hidden

    def decode_tokens(self, hiddens: torch.Tensor) -> np.ndarray[Any, np.dtype[np.float32]]:
        """One-shot decode of ``(T, hidden)`` states (the reference the stream is compared with)."""
        with torch.inference_mode():
            return self._decode_fn(hiddens)

    def warmup(self) -> None:
        """Meet every shape serving will meet before the first request does.

        Prefills every bucket up to the longest expected prompt, then runs one short sequence
        through every block size (allocations, kernels, numba).
        """
        # Without buckets (1) every length is its own shape: too many to warm, so none are.
        if self.prefill_bucket > 1:
            self._warm_prefill_buckets()
        tokens = sum(self.block_schedule) + 1
        request = SequenceRequest(
            seq_id=_WARMUP_ID, text="warm up", params=SynthesisParams(seed=0), max_tokens=tokens
        )
        self.add(request)
        try:
            while _WARMUP_ID in self._seqs:
                self.step([_WARMUP_ID])
        finally:
            self.drop(_WARMUP_ID)

    def _warm_prefill_buckets(self) -> None:
        """Prefill once at every bucket length up to a ``warmup_prompt_chars`` prompt's."""
        with torch.inference_mode():
            longest = self._chat.tokenizer.encode(
                [self.prompt_text("字" * self.warmup_prompt_chars, SynthesisParams())],
                self.num_vq,
                device=self.device,
            )[0].shape[1]
            for length in range(
                self.prefill_bucket, self.prefill_length(int(longest)) + 1, self.prefill_bucket
            ):
                self._prefill_padded(torch.zeros((1, length, self.hidden_size), device=self.device))

    def memory_allocated(self) -> int:
        """Accelerator bytes held by tensors (0 on the CPU); exported as a metric."""
        return int(torch.cuda.memory_allocated(self.device)) if self.device.type == "cuda" else 0

    def close(self) -> None:
        """Release every sequence and the model."""
        self._seqs.clear()
        self._groups.clear()
        for name in ("gpt", "embed", "decoder", "dvae", "vocos"):
            if hasattr(self._chat, name):
                delattr(self._chat, name)
        del self._llama, self._head_w, self._code_w
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
