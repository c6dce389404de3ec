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
(:func:`server.engine.chattts_batch.code_probabilities`: temperature, optional repetition
penalty, top-p, top-k, EOS banned at step 0 like ``ensure_non_empty``). Two deliberate
differences, neither changing the distribution: positions stay integers (stock ChatTTS casts
them to the Llama's dtype, which corrupts positions above 256 in bfloat16), and each row draws
from its own generator (reproducible with a seed, independent of the batch).
``tests/model/test_refine_voice.py`` holds its tokens equal to ``Chat._refine_text``'s.

It costs about one GPT step per output token (up to ``max_new_tokens``, 384 by default), so
it adds to the time to first audio; it is opt-in. Anything with a :class:`Refiner`'s
``refine`` method can stand in for it (tests stub it: random weights write junk).

Only ``server/engine/chattts*.py`` import torch; this is one of them.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.utils.parametrize as parametrize
from transformers.cache_utils import DynamicCache

from server.engine.chattts_batch import MIN_TEMPERATURE, PENALTY_WINDOW, RowSampling, code_probabilities


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


class Refiner(Protocol):
    """What the engine needs from a refinement pass (tests substitute a fixed one)."""

    def refine(self, texts: Sequence[str], params: RefineParams) -> list[str]:
        """The refined text of each of ``texts`` (already through the text pipeline), in order."""
        ...


class TextRefiner:
    """ChatTTS's refinement over a loaded ``ChatTTS.Chat``'s modules (the engine's own).

    Args:
        chat: the loaded ``Chat`` (gpt, embed, tokenizer, speaker).
        device: where the modules live.
    """

    def __init__(self, chat: Any, *, device: torch.device) -> None:
        self._chat = chat
        self._llama = chat.gpt.gpt
        self.device = device
        tokenizer = chat.tokenizer
        self.eos = int(tokenizer.eos_token)
        self.break_0 = int(tokenizer.break_0_ids)
        self.num_vq = int(chat.embed.num_vq)

    def refine(self, texts: Sequence[str], params: RefineParams) -> list[str]:
        """Refined texts, as ``Chat.infer`` hands them to speech generation."""
        kept = [ids[ids < self.break_0] for ids in self.refine_ids(texts, params)]
        decoded: list[str] = self._chat.tokenizer.decode(kept)
        return decoded

    def refine_ids(self, texts: Sequence[str], params: RefineParams) -> list[torch.Tensor]:
        """Each row's generated text-token ids, end-of-text excluded (``Chat._refine_text``'s ``ids``)."""
        if not texts:
            return []
        with torch.inference_mode():
            return self._generate(list(texts), params)

    def _generate(self, texts: list[str], params: RefineParams) -> list[torch.Tensor]:
        chat, dev = self._chat, self.device
        prompts = chat.speaker.decorate_text_prompts(texts, params.prompt)
        input_ids, attention_mask, text_mask = chat.tokenizer.encode(prompts, self.num_vq, device=dev)
        rows = len(texts)
        mask = attention_mask.to(torch.long)
        # Left padding: a row's positions count its own tokens only (ChatTTS: cumsum − 1).
        positions = (mask.cumsum(-1) - 1).masked_fill(mask.eq(0), 1)
        cache = DynamicCache()
        hidden = self._forward(chat.embed(input_ids, text_mask), mask, positions, cache)
        next_position = positions[:, -1:] + 1
        generators = [self._generator(params.seed, row) for row in range(rows)]
        history = torch.full((rows, 1, PENALTY_WINDOW), int(chat.tokenizer.len), dtype=torch.long, device=dev)
        out = torch.zeros((rows, params.max_new_tokens), dtype=torch.long, device=dev)
        ended = torch.full((rows,), params.max_new_tokens, dtype=torch.long)
        for step in range(params.max_new_tokens):
            token = self._sample(hidden, history, params, step, generators)
            out[:, step] = token
            history = torch.cat([history[:, :, 1:], token.view(rows, 1, 1)], dim=2)
            for row in token.eq(self.eos).nonzero().flatten().tolist():
                ended[row] = min(int(ended[row]), step)
            if bool((ended <= step).all()):
                break
            mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=1)
            hidden = self._forward(chat.embed.emb_text(token).unsqueeze(1), mask, next_position, cache)
            next_position = next_position + 1
        return [out[row, : int(ended[row])].cpu() for row in range(rows)]

    def _forward(
        self, emb: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        result = self._llama(
            inputs_embeds=emb.to(self._llama.dtype),
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        hidden: torch.Tensor = result.last_hidden_state[:, -1].float()
        return hidden

    def _sample(
        self,
        hidden: torch.Tensor,
        history: torch.Tensor,
        params: RefineParams,
        step: int,
        generators: list[torch.Generator],
    ) -> torch.Tensor:
        rows = hidden.shape[0]
        with parametrize.cached():  # head_text is weight-normed: compute its weight once
            logits = self._chat.embed.head_text(hidden).float()
        sampling = RowSampling(
            temperature=torch.full((rows,), max(MIN_TEMPERATURE, params.temperature), device=self.device),
            top_p=torch.full((rows,), min(1.0, max(0.0, params.top_p)), device=self.device),
            top_k=torch.full((rows,), max(1, params.top_k), dtype=torch.long, device=self.device),
            suppress_eos=torch.full((rows,), step < max(1, params.min_new_tokens), device=self.device),
        )
        probs = code_probabilities(
            logits.unsqueeze(1), history, sampling, eos=self.eos, repetition_penalty=params.repetition_penalty
        )
        uniforms = torch.stack([torch.rand(1, generator=g) for g in generators]).to(self.device)
        return _draw(probs, uniforms.view(rows, 1))

    @staticmethod
    def _generator(seed: int | None, row: int) -> torch.Generator:
        gen = torch.Generator(device="cpu")
        gen.manual_seed((seed + row) % (1 << 63) if seed is not None else secrets.randbits(63))
        return gen


def _draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row by inverting its CDF at a uniform draw (never a zero-probability token)."""
    cdf = probs.cumsum(dim=-1)
    token = (cdf <= uniforms.to(cdf.dtype) * cdf[:, -1:]).sum(dim=-1).clamp(max=probs.shape[-1] - 1)
    allowed = probs.gather(1, token.unsqueeze(1)).squeeze(1) > 0
    return torch.where(allowed, token, probs.argmax(dim=-1))
