"""ChatTTS's refinement pass: the text model rewrites a segment with prosody tags before speech.

``Chat.infer`` runs it by default (``skip_refine_text=False``): the GPT, in text mode, reads
``[Sbreak]{normalized text}[Pbreak]{prompt}`` and writes the text again with ``[uv_break]``,
``[laugh]``, ``[lbreak]`` and oral fillers where a speaker would put them; ``infer`` then drops
every token from ``[break_0]`` on in the vocabulary (the numbered style controls), decodes the
rest with the tokenizer and generates speech from that text **without normalizing it again**.
The prompt (``RefineParams.prompt``, e.g. ``[oral_2][laugh_0][break_6]``) sets how much of
each the model adds.

:class:`TextRefiner` is that pass over the engine's own loaded modules, batched (several
texts left-padded into one batch, as ``Chat._refine_text`` does) with ChatTTS's sampling chain
(:func:`server.engine.chattts.step.sampling.code_probabilities`: temperature, optional repetition
penalty, top-p, top-k, EOS banned at step 0 like ``ensure_non_empty``). Two deliberate
differences, neither changing the distribution: positions stay integers (stock ChatTTS casts
them to the Llama's dtype, which corrupts positions above 256 in bfloat16), and each row draws
from its own generator (reproducible with a seed, independent of the batch).
``tests/model/test_refine_voice.py`` holds its tokens equal to ``Chat._refine_text``'s.

It costs about one GPT step per output token (up to ``max_new_tokens``, 384 by default), so
it adds to the time to first audio; it is opt-in (``refine: true``). A refinement is a
:class:`RefineJob` that runs a few tokens at a time: the engine's
:class:`server.engine.chattts.refine_queue.RefineQueue` starts
one job for the sequences that begin refining in the same step (one batch) and advances every
job by one block per engine step, between the other streams' token blocks, so a long
refinement never stalls the streams that are already speaking. Anything with a
:class:`Refiner`'s ``start`` can stand in for :class:`TextRefiner` (tests stub it: random
weights write junk).

Only ``server/engine/chattts*.py`` import torch; this is one of them.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

from server.engine.chattts.step.sampling import (
    MIN_TEMPERATURE,
    PENALTY_WINDOW,
    RowSampling,
    code_probabilities,
)


@dataclass(frozen=True, kw_only=True)
class RefineParams:
    """ChatTTS's ``RefineTextParams`` (same defaults), plus a seed for reproducible rows.

    Attributes:
        prompt: written after ``[Pbreak]``: the sentence-level controls, e.g.
            ``[oral_2][laugh_0][break_6]`` (empty: the model's own choice).
        temperature: sampling temperature (ChatTTS: 0.7).
        top_p: nucleus threshold (0.7).
        top_k: top-k cut-off (20).
        repetition_penalty: over the last 16 tokens (1.0: off).
        max_new_tokens: the rewrite's length limit in tokens (384).
        min_new_tokens: end-of-text banned before this many tokens (0; step 0 is always banned,
            as ChatTTS's ``ensure_non_empty`` regenerates an empty result).
        seed: row ``i`` draws from a generator seeded with ``seed + i``; ``None`` = random.
    """

    prompt: str = ""
    temperature: float = 0.7
    top_p: float = 0.7
    top_k: int = 20
    repetition_penalty: float = 1.0
    max_new_tokens: int = 384
    min_new_tokens: int = 0
    seed: int | None = None


@dataclass(frozen=True)
class RefineRow:
    """One text to refine.

    Attributes:
        text: the text after the text pipeline (``ChatTTSText.model_text``).
        prompt: the sentence-level controls written after ``[Pbreak]``.
        seed: the row's generator seed; ``None`` = random.
    """

    text: str
    prompt: str = ""
    seed: int | None = None


class RefineJob(Protocol):
    """A refinement of some rows in progress (one batch)."""

    def advance(self, tokens: int) -> bool:
        """Generate up to ``tokens`` more tokens for every row; True once every row has ended."""
        ...

    def texts(self) -> list[str]:
        """Each row's refined text, as ``infer`` hands it to speech (once :meth:`advance` said done)."""
        ...

    def keep(self, rows: Sequence[int]) -> None:
        """Go on with only these rows (indices among the current ones, in order)."""
        ...


class Refiner(Protocol):
    """What the engine needs from a refinement pass (tests substitute a fixed one)."""

    def start(self, rows: Sequence[RefineRow], params: RefineParams) -> RefineJob:
        """Begin refining ``rows`` in one batch (their prompts are prefilled here)."""
        ...


class TextRefiner:
    """ChatTTS's refinement over a loaded ``ChatTTS.Chat``'s modules (the engine's own).

    Args:
        chat: the loaded ``Chat`` (gpt, embed, tokenizer, speaker).
        device: where the modules live.
    """

    def __init__(self, chat: Any, *, device: torch.device) -> None:
        self.chat = chat
        self.llama = chat.gpt.gpt
        self.device = device
        tokenizer = chat.tokenizer
        self.eos = int(tokenizer.eos_token)
        self.break_0 = int(tokenizer.break_0_ids)
        self.num_vq = int(chat.embed.num_vq)

    @cached_property
    def head_weight(self) -> torch.Tensor:
        """``head_text``'s weight, computed once on first use.

        The module is weight-normed: calling it recomputes the whole vocabulary-by-hidden matrix,
        which was most of a refinement token's time on the CPU.
        """
        with torch.no_grad():
            weight: torch.Tensor = self.chat.embed.head_text.weight.detach()
        return weight

    def start(self, rows: Sequence[RefineRow], params: RefineParams) -> TextRefineJob:
        """Begin refining ``rows``: one left-padded batch, as ``Chat._refine_text`` builds it."""
        return TextRefineJob(self, rows, params)

    def refine(self, texts: Sequence[str], params: RefineParams) -> list[str]:
        """Refined texts in one go (``params.prompt`` for all; row ``i`` seeded ``params.seed + i``)."""
        job = self._run(texts, params)
        return job.texts() if job is not None else []

    def refine_ids(self, texts: Sequence[str], params: RefineParams) -> list[torch.Tensor]:
        """Each row's generated text-token ids, end-of-text excluded (``Chat._refine_text``'s ``ids``)."""
        job = self._run(texts, params)
        return job.ids() if job is not None else []

    def _run(self, texts: Sequence[str], params: RefineParams) -> TextRefineJob | None:
        if not texts:
            return None
        seed = params.seed
        rows = [
            RefineRow(text, params.prompt, None if seed is None else (seed + i) % (1 << 63))
            for i, text in enumerate(texts)
        ]
        job = self.start(rows, params)
        while not job.advance(params.max_new_tokens):
            pass
        return job


class TextRefineJob:
    """One batch of rows being refined: the GPT's cache and every row's sampling state."""

    def __init__(self, refiner: TextRefiner, rows: Sequence[RefineRow], params: RefineParams) -> None:
        self._refiner, self._params = refiner, params
        chat, dev = refiner.chat, refiner.device
        prompts = [chat.speaker.decorate_text_prompts([row.text], row.prompt)[0] for row in rows]
        count = len(rows)
        with torch.inference_mode():
            input_ids, attention_mask, text_mask = chat.tokenizer.encode(prompts, refiner.num_vq, device=dev)
            self._mask = attention_mask.to(torch.long)
            # Left padding: a row's positions count its own tokens only (ChatTTS: cumsum − 1).
            positions = (self._mask.cumsum(-1) - 1).masked_fill(self._mask.eq(0), 1)
            self._cache = DynamicCache()
            self._hidden = self._forward(chat.embed(input_ids, text_mask), positions)
        self._next_position = positions[:, -1:] + 1
        self._generators = [_generator(row.seed) for row in rows]
        width = (count, 1, PENALTY_WINDOW)
        self._history = torch.full(width, int(chat.tokenizer.len), dtype=torch.long, device=dev)
        self._out = torch.zeros((count, params.max_new_tokens), dtype=torch.long, device=dev)
        self._ended = torch.full((count,), params.max_new_tokens, dtype=torch.long)
        self._step = 0
        self.done = params.max_new_tokens <= 0

    def advance(self, tokens: int) -> bool:
        """Up to ``tokens`` more tokens per row; True once every row has ended (or hit the cap)."""
        with torch.inference_mode():
            for _ in range(tokens):
                if self.done:
                    break
                self._one_token()
        return self.done

    def _one_token(self) -> None:
        refiner, step = self._refiner, self._step
        token = _sample(refiner, self._hidden, self._history, self._params, step, self._generators)
        rows = token.shape[0]
        self._out[:, step] = token
        self._history = torch.cat([self._history[:, :, 1:], token.view(rows, 1, 1)], dim=2)
        for row in token.eq(refiner.eos).nonzero().flatten().tolist():
            self._ended[row] = min(int(self._ended[row]), step)
        self._step += 1
        if bool((self._ended <= step).all()) or self._step >= self._params.max_new_tokens:
            self.done = True  # the last token needs no forward pass
            return
        self._mask = torch.cat([self._mask, self._mask.new_ones((rows, 1))], dim=1)
        emb = refiner.chat.embed.emb_text(token).unsqueeze(1)
        self._hidden = self._forward(emb, self._next_position)
        self._next_position = self._next_position + 1

    def _forward(self, emb: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        llama = self._refiner.llama
        result = llama(
            inputs_embeds=emb.to(llama.dtype),
            attention_mask=self._mask,
            position_ids=positions,
            past_key_values=self._cache,
            use_cache=True,
        )
        hidden: torch.Tensor = result.last_hidden_state[:, -1].float()
        return hidden

    def keep(self, rows: Sequence[int]) -> None:
        """Go on with only ``rows`` (a dropped row's cache and state are freed)."""
        index = torch.tensor(list(rows), dtype=torch.long)
        on_device = index.to(self._refiner.device)
        self._cache.batch_select_indices(on_device)
        self._mask = self._mask[on_device]
        self._next_position = self._next_position[on_device]
        self._hidden = self._hidden[on_device]
        self._history = self._history[on_device]
        self._out = self._out[on_device]
        self._ended = self._ended[index]
        self._generators = [self._generators[i] for i in rows]

    def ids(self) -> list[torch.Tensor]:
        """Each row's generated ids, end-of-text excluded."""
        return [self._out[row, : int(self._ended[row])].cpu() for row in range(self._out.shape[0])]

    def texts(self) -> list[str]:
        """``infer``'s hand-over: every token from ``[break_0]`` on dropped, the rest decoded."""
        kept = [ids[ids < self._refiner.break_0] for ids in self.ids()]
        decoded: list[str] = self._refiner.chat.tokenizer.decode(kept)
        return decoded


def _sample(
    refiner: TextRefiner,
    hidden: torch.Tensor,
    history: torch.Tensor,
    params: RefineParams,
    step: int,
    generators: list[torch.Generator],
) -> torch.Tensor:
    """One text token per row through ChatTTS's sampling chain (row ``i`` draws from ``generators[i]``)."""
    rows, dev = hidden.shape[0], refiner.device
    logits = F.linear(hidden, refiner.head_weight).float()
    sampling = RowSampling(
        temperature=torch.full((rows,), max(MIN_TEMPERATURE, params.temperature), device=dev),
        top_p=torch.full((rows,), min(1.0, max(0.0, params.top_p)), device=dev),
        top_k=torch.full((rows,), max(1, params.top_k), dtype=torch.long, device=dev),
        suppress_eos=torch.full((rows,), step < max(1, params.min_new_tokens), device=dev),
    )
    probs = code_probabilities(
        logits.unsqueeze(1), history, sampling, eos=refiner.eos, repetition_penalty=params.repetition_penalty
    )
    uniforms = torch.stack([torch.rand(1, generator=g) for g in generators]).to(dev)
    return _draw(probs, uniforms.view(rows, 1))


def _generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed % (1 << 63) if seed is not None else secrets.randbits(63))
    return gen


def _draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row by inverting its CDF at a uniform draw (never a zero-probability token)."""
    cdf = probs.cumsum(dim=-1)
    token = (cdf <= uniforms.to(cdf.dtype) * cdf[:, -1:]).sum(dim=-1).clamp(max=probs.shape[-1] - 1)
    allowed = probs.gather(1, token.unsqueeze(1)).squeeze(1) > 0
    return torch.where(allowed, token, probs.argmax(dim=-1))
