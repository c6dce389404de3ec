"""Per-row sampling of a batch, on the model device: counter-based random streams and ChatTTS's chain.

Every function here is made of torch ops on fixed-shape tensors, with no host
transfer and no data-dependent shape, so that the engine's token step
(:mod:`server.engine.chattts.step.token_step`) can be captured as one CUDA graph.

Random numbers come from a counter-based generator: the uniform that row
``b`` uses for code stream ``q`` of its ``i``-th token is a hash of
(the row's key, ``i · num_vq + q``). The key is derived once from the
sequence's seed (``params.seed + seed_offset``) on the host. A row's draws
therefore depend on nothing but its own seed and token index: not on the
batch it shares, not on the order of calls, not on the device. The hash is
murmur3's 32-bit finalizer, applied twice with the key mixed in between
(24 bits of each result make the uniform); it is a statistical generator,
not a cryptographic one. It gives different numbers for a seed than the
``torch.Generator`` the engine used before; what it guarantees is the same
sequence for the same seed, alone or in any batch.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from server.engine_api import SequenceRequest

#: Repetition-penalty window of ChatTTS's ``CustomRepetitionPenaltyLogitsProcessorRepeat``.
PENALTY_WINDOW = 16
#: HF's top-p/top-k warpers as ChatTTS builds them keep at least this many tokens.
MIN_TOKENS_TO_KEEP = 3
#: Only guards the division: ChatTTS divides by any positive temperature, so near-greedy
#: settings (1e-12) must reach the logits unchanged to stay token-identical to it.
MIN_TEMPERATURE = 1e-30

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1


def seed_of(request: SequenceRequest) -> int:
    """A sequence's seed: its stream's plus the segment's index (``seed_offset``), or a random one."""
    seed = request.params.seed
    return (seed + request.seed_offset) % (1 << 63) if seed is not None else secrets.randbits(63)


def stream_key(seed: int) -> tuple[int, int]:
    """Two 32-bit keys for a sequence's random stream: splitmix64 of ``seed`` (host, once per sequence)."""
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & _MASK32, z >> 32


def _mul32(x: torch.Tensor, factor: int) -> torch.Tensor:
    """``(x · factor) mod 2³²`` for int64 ``x`` in ``[0, 2³²)``, with no int64 overflow.

    The factor is split in 16-bit halves, so every product stays below 2⁴⁸.
    """
    low = x * (factor & 0xFFFF)
    high = ((x * (factor >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer (a bijection with full avalanche) on int64 values in ``[0, 2³²)``."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def counter_uniforms(
    key0: torch.Tensor, key1: torch.Tensor, token_index: torch.Tensor, stream_index: torch.Tensor
) -> torch.Tensor:
    """The uniforms in ``[0, 1)`` of every row's next token, one per code stream.

    Args:
        key0: ``(B,)`` int64, the first 32-bit key of each row (:func:`stream_key`).
        key1: ``(B,)`` int64, the second key.
        token_index: ``(B,)`` int64, how many tokens each row has generated.
        stream_index: ``(num_vq,)`` int64 ``arange(num_vq)`` (kept by the caller, so nothing
            is allocated from host data inside a captured step).

    Returns:
        ``(B, num_vq)`` float32.
    """
    num_vq = stream_index.shape[0]
    counter = (token_index.unsqueeze(1) * num_vq + stream_index.unsqueeze(0)) & _MASK32
    h = _fmix32(counter ^ key0.unsqueeze(1))
    h = _fmix32(h ^ key1.unsqueeze(1))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


@dataclass(frozen=True)
class RowSampling:
    """Per-row sampling settings, stacked: each tensor is ``(B,)`` on the model device."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    suppress_eos: torch.Tensor


def _per_stream(x: torch.Tensor, q: int) -> torch.Tensor:
    """``(B,)`` → ``(B·q,)``, each row's value repeated for its q streams (no host sync)."""
    return x.unsqueeze(1).expand(x.shape[0], q).reshape(-1)


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
    length, softmax.

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
        # A Python base, as ChatTTS writes it (and no tensor made from host data in a captured step).
        alpha = torch.pow(repetition_penalty, freq[..., :v])
        x = torch.where(x < 0, x * alpha, x / alpha)
    x = x.reshape(b * q, v)
    # top-p (HF TopPLogitsWarper): drop the low tail whose mass is <= 1 - top_p.
    top_p = _per_stream(sampling.top_p, q).unsqueeze(1)
    sorted_logits, sorted_idx = torch.sort(x, descending=False, dim=-1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - top_p)
    remove[:, -MIN_TOKENS_TO_KEEP:] = False
    x = x.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))
    # top-k (HF TopKLogitsWarper).
    top_k = _per_stream(sampling.top_k.clamp(min=MIN_TOKENS_TO_KEEP, max=v), q)
    # Top-p removed a prefix of the ascending sort (its cumulative mass only grows), so the k-th
    # largest value left is read from that sort: no second sort per token.
    kth = sorted_logits.masked_fill(remove, float("-inf")).gather(1, (v - top_k).unsqueeze(1))
    x = x.masked_fill(x < kth, float("-inf"))
    ban = _per_stream(sampling.suppress_eos, q)
    x[:, eos] = x[:, eos].masked_fill(ban, float("-inf"))
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

    The draw inverts the CDF at ``uniforms`` (each row's own random stream), so a row's
    result does not depend on the other rows.

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
