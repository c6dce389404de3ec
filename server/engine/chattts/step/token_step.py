"""The ChatTTS engine's static token step: per-slot device state and one function of (batch, length).

:class:`SlotState` holds everything a token step reads and writes, one row
per KV slot, in tensors allocated once on the model device: the last hidden
state, the repetition-penalty window, lengths and token counts, sampling
settings, random-stream keys, which rows step, and the block's outputs.
:class:`TokenStep` advances slots ``[0, b)`` by one token with attention over
``[0, length)``: logits, counter-based draws, ChatTTS's sampling chain, the
code embedding and the Llama layers with the KV cache written in place. It
reads no host data, moves nothing to the host and changes state only in
place, so that on CUDA each ``(b, length)`` is captured once as a graph and
replayed (:mod:`server.engine.chattts.step.graphs`); on the CPU the same function
runs eagerly.

Only ``server/engine/chattts*.py`` import torch; this is one of them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from server.engine.chattts.step.kv import SlotKV
from server.engine.chattts.step.llama import Attention, attention_for, decode_layers
from server.engine.chattts.step.sampling import (
    PENALTY_WINDOW,
    RowSampling,
    counter_uniforms,
    sample_codes,
)
from server.engine.chattts.step.summary import upload

#: The long per-slot settings a joining sequence brings, in :meth:`SlotState.join`'s column order.
JOIN_INTS = ("lengths", "max_tokens", "top_k", "key0", "key1")
#: Its float settings, in column order.
JOIN_FLOATS = ("temperature", "top_p")


@dataclass(eq=False)
class SlotState:
    """Per-slot tensors on the model device (row ``s`` belongs to whatever sequence holds slot ``s``).

    Attributes:
        hidden: ``(S, hidden)`` float32 last hidden state; it predicts the next token.
        history: ``(S, num_vq, PENALTY_WINDOW)`` recent codes (``num_audio_tokens`` = empty).
        lengths: ``(S,)`` filled KV positions.
        tokens: ``(S,)`` tokens generated (also the random stream's counter).
        max_tokens: ``(S,)`` token cap.
        temperature, top_p, top_k: ``(S,)`` sampling settings.
        key0, key1: ``(S,)`` random-stream keys.
        stepping: ``(S,)`` bool, the row takes part in this block and has not ended.
        produced: ``(S,)`` tokens accepted in this block.
        pending_hidden: ``(S, block, hidden)`` the states that produced this block's tokens.
        pending_codes: ``(S, block, num_vq)`` this block's codes.
        slot_index: ``arange(S)``; stream_index: ``arange(num_vq)``; columns: ``arange(max_len)``.
    """

    hidden: torch.Tensor
    history: torch.Tensor
    lengths: torch.Tensor
    tokens: torch.Tensor
    max_tokens: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    key0: torch.Tensor
    key1: torch.Tensor
    stepping: torch.Tensor
    produced: torch.Tensor
    pending_hidden: torch.Tensor
    pending_codes: torch.Tensor
    slot_index: torch.Tensor
    stream_index: torch.Tensor
    columns: torch.Tensor

    @classmethod
    def allocate(
        cls,
        *,
        slots: int,
        hidden_size: int,
        num_vq: int,
        block: int,
        max_len: int,
        empty_code: int,
        device: torch.device,
    ) -> SlotState:
        """Every tensor, allocated once."""

        def long(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        def count(n: int) -> torch.Tensor:
            return torch.arange(n, dtype=torch.long, device=device)

        return cls(
            hidden=torch.zeros((slots, hidden_size), device=device),
            history=long(slots, num_vq, PENALTY_WINDOW).fill_(empty_code),
            lengths=long(slots),
            tokens=long(slots),
            max_tokens=long(slots).fill_(1),
            temperature=torch.ones(slots, device=device),
            top_p=torch.ones(slots, device=device),
            top_k=long(slots).fill_(1),
            key0=long(slots),
            key1=long(slots),
            stepping=torch.zeros(slots, dtype=torch.bool, device=device),
            produced=long(slots),
            pending_hidden=torch.zeros((slots, block, hidden_size), device=device),
            pending_codes=long(slots, block, num_vq),
            slot_index=count(slots),
            stream_index=count(num_vq),
            columns=count(max_len),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by name (tests check that a step replaces none of them)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def join(
        self,
        slots: torch.Tensor,
        *,
        hidden: torch.Tensor,
        ints: torch.Tensor,
        floats: torch.Tensor,
        empty_code: int,
    ) -> None:
        """Give ``slots`` (a device index) to freshly prefilled sequences, one each; no other row is touched.

        Indexed copies only, so that a captured prefill joins its rows in the same graph.

        Args:
            slots: ``(n,)`` long, the slots.
            hidden: ``(n, hidden)`` float32, each sequence's state after its last prompt token.
            ints: ``(n, 5)`` long, the columns of :data:`JOIN_INTS` (clamped already).
            floats: ``(n, 2)`` float32, the columns of :data:`JOIN_FLOATS` (clamped already).
            empty_code: the history's empty value.
        """
        self.hidden.index_copy_(0, slots, hidden)
        self.history.index_fill_(0, slots, empty_code)
        self.tokens.index_fill_(0, slots, 0)
        for column, name in enumerate(JOIN_INTS):
            getattr(self, name).index_copy_(0, slots, ints[:, column])
        for column, name in enumerate(JOIN_FLOATS):
            getattr(self, name).index_copy_(0, slots, floats[:, column])

    def begin_block(self, slots: list[int]) -> None:
        """Mark the rows of this block as stepping and clear the block's outputs."""
        self.stepping.zero_()
        self.stepping[upload(slots, self.stepping.device)] = True
        self.produced.zero_()


class TokenStep:
    """One token for slots ``[0, b)`` with attention over ``[0, length)``: ``step(b, length)``.

    Args:
        llama: the loaded ``LlamaModel`` (its layers, rotary embedding and norm are used).
        kv: the slot cache.
        state: the per-slot state.
        head_w: ``(num_vq, V, hidden)`` float32 code heads, stacked.
        code_w: ``(num_vq, V, hidden)`` float32 code embeddings, stacked.
        eos: the end code.
        min_tokens: EOS is banned before this many tokens.
        repetition_penalty: ChatTTS's penalty over the last 16 codes.
        dtype: the Llama's dtype.
        attend: the attention (default: :func:`~server.engine.chattts.step.llama.attention_for` the device).
    """

    def __init__(
        self,
        llama: Any,
        kv: SlotKV,
        state: SlotState,
        *,
        head_w: torch.Tensor,
        code_w: torch.Tensor,
        eos: int,
        min_tokens: int,
        repetition_penalty: float,
        dtype: torch.dtype,
        attend: Attention | None = None,
    ) -> None:
        self.llama, self.kv, self.state = llama, kv, state
        self.head_w, self.code_w = head_w, code_w
        self.eos, self.min_tokens, self.dtype = eos, min_tokens, dtype
        self.repetition_penalty = repetition_penalty
        self.attend = attend or attention_for(state.hidden.device)
        self.block = int(state.pending_hidden.shape[1])

    def __call__(self, b: int, length: int) -> None:
        """Sample a token for every stepping row, feed it, and update the state in place."""
        st = self.state
        hidden, stepping, tokens = st.hidden[:b], st.stepping[:b], st.tokens[:b]
        logits = torch.einsum("bh,qvh->bqv", hidden, self.head_w)
        uniforms = counter_uniforms(st.key0[:b], st.key1[:b], tokens, st.stream_index)
        sampling = RowSampling(
            temperature=st.temperature[:b],
            top_p=st.top_p[:b],
            top_k=st.top_k[:b],
            suppress_eos=tokens < self.min_tokens,
        )
        codes = sample_codes(
            logits,
            st.history[:b],
            sampling,
            uniforms,
            eos=self.eos,
            repetition_penalty=self.repetition_penalty,
        )
        accept = stepping & codes.ne(self.eos).all(dim=1)
        self._record(b, accept, hidden, codes)
        new_tokens = tokens + accept
        go_on = accept & (new_tokens < st.max_tokens[:b])
        shifted = torch.cat([st.history[:b, :, 1:], codes.unsqueeze(2)], dim=2)
        st.history[:b] = torch.where(stepping.view(b, 1, 1), shifted, st.history[:b])
        st.tokens[:b] = new_tokens
        new_hidden = self._feed(codes, b, length)
        st.hidden[:b] = torch.where(go_on.unsqueeze(1), new_hidden, hidden)
        st.lengths[:b] += go_on
        st.stepping[:b] = go_on

    def _record(self, b: int, accept: torch.Tensor, hidden: torch.Tensor, codes: torch.Tensor) -> None:
        """Keep the state that produced each accepted token (and the code) at the row's block index."""
        st = self.state
        rows = st.slot_index[:b]
        at = st.produced[:b].clamp(max=self.block - 1)
        keep = accept.unsqueeze(1)
        st.pending_hidden[rows, at] = torch.where(keep, hidden, st.pending_hidden[rows, at])
        st.pending_codes[rows, at] = torch.where(keep, codes, st.pending_codes[rows, at])
        st.produced[:b] += accept

    def _feed(self, codes: torch.Tensor, b: int, length: int) -> torch.Tensor:
        """Run the Llama on the codes' embeddings at each row's next position; new hidden states."""
        st = self.state
        emb = self.code_w[st.stream_index, codes].sum(dim=1)
        lengths = st.lengths[:b]
        positions = lengths.unsqueeze(1)
        mask = (st.columns[:length].unsqueeze(0) <= positions).view(b, 1, 1, length)
        cache = self.kv.step_view(st.slot_index[:b], lengths, length)
        out = decode_layers(self.llama, emb.unsqueeze(1).to(self.dtype), positions, cache, mask, self.attend)
        return out[:, -1].float()
