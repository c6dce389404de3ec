"""Padded KV-cache row groups and per-row sampling for the ChatTTS engine.

A :class:`RowGroup` holds the KV cache of several sequences left-padded to one
length (text-generation-inference's ``CausalLMBatch`` idea): rows can be
selected out (:meth:`RowGroup.select`) and groups concatenated
(:func:`concat_groups`) between token blocks, so sequences join and leave the
batch at block boundaries. Each layer's cache is a preallocated buffer that
grows by doubling, because transformers' ``DynamicLayer`` concatenates on
every token (quadratic copying over a long sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

#: Repetition-penalty window of ChatTTS's ``CustomRepetitionPenaltyLogitsProcessorRepeat``.
PENALTY_WINDOW = 16
#: Only guards the division: ChatTTS divides by any positive temperature, so near-greedy
#: settings (1e-12) must reach the logits unchanged to stay token-identical to it.
MIN_TEMPERATURE = 1e-30
#: HF's top-p/top-k warpers as ChatTTS builds them keep at least this many tokens.
MIN_TOKENS_TO_KEEP = 3


class GrowLayer(DynamicLayer):
    """One layer's KV cache in a buffer with spare capacity (amortized O(1) append)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._k = keys
        self._v = values
        self._n = length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._views()

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._k[:, :, : self._n], self._v[:, :, : self._n]
        self.keys, self.values = keys, values
        return keys, values

    def filled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the filled positions ``(B, heads, length, head_dim)``."""
        return self._k[:, :, : self._n], self._v[:, :, : self._n]

    @property
    def length(self) -> int:
        """Filled positions."""
        return self._n

    def lazy_initialization(self, key_states: torch.Tensor) -> None:
        """Buffers exist from construction; nothing to do."""

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k`` positions in place; return views of everything cached."""
        k = key_states.shape[-2]
        if self._n + k > self._k.shape[2]:
            cap = max(2 * self._k.shape[2], self._n + k + 64)
            self._k = _regrow(self._k, self._n, cap)
            self._v = _regrow(self._v, self._n, cap)
        self._k[:, :, self._n : self._n + k].copy_(key_states)
        self._v[:, :, self._n : self._n + k].copy_(value_states)
        self._n += k
        return self._views()

    def truncate(self, length: int) -> None:
        """Forget positions from ``length`` on (undoes a failed forward's appends)."""
        self._n = min(self._n, length)
        self._views()

    def rows(self, index: torch.Tensor, trim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The filled part of rows ``index`` without the first ``trim`` positions."""
        return self._k[index, :, trim : self._n], self._v[index, :, trim : self._n]


def _regrow(buf: torch.Tensor, n: int, cap: int) -> torch.Tensor:
    new = buf.new_zeros((buf.shape[0], buf.shape[1], cap, buf.shape[3]))
    new[:, :, :n].copy_(buf[:, :, :n])
    return new


def _buffers(parts: list[torch.Tensor], pads: list[int], headroom: int) -> torch.Tensor:
    """Left-pad ``parts`` (each ``(b, heads, len, dim)``) to one length and stack them in a new buffer."""
    length = max(p.shape[2] + pad for p, pad in zip(parts, pads, strict=True))
    ref = parts[0]
    out = ref.new_zeros((sum(p.shape[0] for p in parts), ref.shape[1], length + headroom, ref.shape[3]))
    row = 0
    for p, pad in zip(parts, pads, strict=True):
        out[row : row + p.shape[0], :, pad : pad + p.shape[2]].copy_(p)
        row += p.shape[0]
    return out


@dataclass
class RowGroup:
    """Sequences whose KV caches share one left-padded buffer per layer.

    Attributes:
        ids: sequence id of each row.
        layers: per-layer caches.
        pads: left padding of each row (``(B,)`` long, on the model device).
        hidden: ``(B, hidden)`` float32 last hidden state per row: it predicts the next token.
        history: ``(B, num_vq, PENALTY_WINDOW)`` last generated codes (``num_audio_tokens`` = empty).
    """

    ids: list[int]
    layers: list[GrowLayer]
    pads: torch.Tensor
    hidden: torch.Tensor
    history: torch.Tensor

    @property
    def length(self) -> int:
        """Padded cache length."""
        return self.layers[0].length

    def cache(self) -> Cache:
        """A transformers ``Cache`` over this group's layers (for one forward call)."""
        return Cache(layers=list(self.layers))

    def attention_mask(self, new: int) -> torch.Tensor | None:
        """``(B, length + new)`` mask hiding left padding; ``None`` when no row is padded."""
        if not bool(self.pads.any()):
            return None
        cols = torch.arange(self.length + new, device=self.pads.device)
        return (cols.unsqueeze(0) >= self.pads.unsqueeze(1)).to(torch.long)

    def positions(self, new: int) -> torch.Tensor:
        """``(B, new)`` position ids of the next ``new`` tokens (real positions, padding excluded)."""
        start = self.length - self.pads
        return start.unsqueeze(1) + torch.arange(new, device=self.pads.device).unsqueeze(0)

    def select(self, keep: list[int], headroom: int = 64) -> RowGroup:
        """A new group with the rows ``keep`` (sequence ids), padding trimmed to the minimum."""
        index_list = [self.ids.index(s) for s in keep]
        index = torch.tensor(index_list, device=self.pads.device, dtype=torch.long)
        pads = self.pads.index_select(0, index)
        trim = int(pads.min())
        layers = []
        for layer in self.layers:
            k, v = layer.rows(index, trim)
            layers.append(GrowLayer(_buffers([k], [0], headroom), _buffers([v], [0], headroom), k.shape[2]))
        return RowGroup(
            ids=list(keep),
            layers=layers,
            pads=pads - trim,
            hidden=self.hidden.index_select(0, index),
            history=self.history.index_select(0, index),
        )


def concat_groups(groups: list[RowGroup], headroom: int = 64) -> RowGroup:
    """One group holding every row of ``groups`` (left-padded to the longest)."""
    if len(groups) == 1:
        return groups[0]
    length = max(g.length for g in groups)
    extra = [length - g.length for g in groups]
    layers = []
    for i in range(len(groups[0].layers)):
        ks = [g.layers[i].filled()[0] for g in groups]
        vs = [g.layers[i].filled()[1] for g in groups]
        layers.append(GrowLayer(_buffers(ks, extra, headroom), _buffers(vs, extra, headroom), length))
    return RowGroup(
        ids=[s for g in groups for s in g.ids],
        layers=layers,
        pads=torch.cat([g.pads + e for g, e in zip(groups, extra, strict=True)]),
        hidden=torch.cat([g.hidden for g in groups]),
        history=torch.cat([g.history for g in groups]),
    )


def empty_layers(
    n_layers: int,
    batch: int,
    heads: int,
    head_dim: int,
    capacity: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[GrowLayer]:
    """Fresh empty caches for a prefill."""
    shape = (batch, heads, capacity, head_dim)
    return [
        GrowLayer(
            torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device), 0
        )
        for _ in range(n_layers)
    ]


@dataclass(frozen=True)
class RowSampling:
    """Per-row sampling settings, stacked: each tensor is ``(B,)`` on the model device."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    suppress_eos: torch.Tensor


def code_probabilities(
    logits: torch.Tensor,
    history: torch.Tensor,
    sampling: RowSampling,
    *,
    eos: int,
    repetition_penalty: float,
) -> torch.Tensor:
    """The distribution each stream's next code is drawn from, ChatTTS-style.

    The order matches ChatTTS's ``GPT.generate`` for audio codes: divide by
    temperature, repetition penalty over the last 16 codes, top-p, top-k
    (HF warpers, at least 3 tokens kept), EOS banned below the minimum
    length, softmax. ``tests/model/test_native_equivalence.py`` holds it
    equal to ChatTTS's own processors.

    Args:
        logits: ``(B, num_vq, V)`` float32.
        history: ``(B, num_vq, W)`` recent codes; value ``V`` marks an empty slot.
        sampling: per-row settings.
        eos: the end code (``V - 1``).
        repetition_penalty: ChatTTS default 1.05.

    Returns:
        ``(B * num_vq, V)`` probabilities, row ``b * num_vq + q`` for stream ``q`` of row ``b``.
    """
    b, q, v = logits.shape
    x = logits / sampling.temperature.view(b, 1, 1)
    if repetition_penalty != 1.0:
        freq = torch.zeros((b, q, v + 1), dtype=x.dtype, device=x.device)
        freq.scatter_add_(2, history, torch.ones_like(history, dtype=x.dtype))
        alpha = torch.pow(torch.tensor(repetition_penalty, dtype=x.dtype, device=x.device), freq[..., :v])
        x = torch.where(x < 0, x * alpha, x / alpha)
    x = x.reshape(b * q, v)
    # top-p (HF TopPLogitsWarper): drop the low tail whose mass is <= 1 - top_p.
    top_p = sampling.top_p.repeat_interleave(q).unsqueeze(1)
    sorted_logits, sorted_idx = torch.sort(x, descending=False, dim=-1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - top_p)
    remove[:, -MIN_TOKENS_TO_KEEP:] = False
    x = x.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))
    # top-k (HF TopKLogitsWarper).
    top_k = sampling.top_k.clamp(min=MIN_TOKENS_TO_KEEP, max=v).repeat_interleave(q)
    kth = torch.sort(x, descending=True, dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))
    x = x.masked_fill(x < kth, float("-inf"))
    ban = sampling.suppress_eos.repeat_interleave(q)
    x[:, eos] = torch.where(ban, torch.full_like(x[:, eos], float("-inf")), x[:, eos])
    return x.softmax(dim=-1)


def sample_codes(
    logits: torch.Tensor,
    history: torch.Tensor,
    sampling: RowSampling,
    uniforms: torch.Tensor,
    *,
    eos: int,
    repetition_penalty: float,
) -> torch.Tensor:
    """Draw the next code of every stream of every row from :func:`code_probabilities`.

    The draw inverts the CDF at ``uniforms`` (drawn from each row's own
    generator), so a row's result does not depend on the other rows' random state.

    Args:
        logits: ``(B, num_vq, V)`` float32.
        history: ``(B, num_vq, W)`` recent codes; value ``V`` marks an empty slot.
        sampling: per-row settings.
        uniforms: ``(B, num_vq)`` in ``[0, 1)``.
        eos: the end code (``V - 1``).
        repetition_penalty: ChatTTS default 1.05.

    Returns:
        ``(B, num_vq)`` long codes.
    """
    b, q, v = logits.shape
    probs = code_probabilities(logits, history, sampling, eos=eos, repetition_penalty=repetition_penalty)
    cdf = probs.cumsum(dim=-1)
    u = uniforms.reshape(b * q, 1).to(cdf.dtype) * cdf[:, -1:]
    codes = (cdf <= u).sum(dim=-1).clamp(max=v - 1)
    # A zero-probability code can only be hit at cdf plateaus; step to the next allowed one.
    codes = torch.where(probs.gather(1, codes.unsqueeze(1)).squeeze(1) > 0, codes, probs.argmax(dim=-1))
    return codes.view(b, q)


def push_history(history: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Shift ``codes`` (``(B, num_vq)``) into the repetition-penalty window."""
    return torch.cat([history[:, :, 1:], codes.unsqueeze(2)], dim=2)
