"""ChatTTS's Llama run layer by layer: prompts through transformers' own layers, token steps through ours.

Prefill (many positions, one sequence) calls the ``LlamaDecoderLayer`` modules
as ``LlamaModel.forward`` does, minus its mask construction (which inspects mask
values on the host): with no mask, SDPA applies its causal mask, as
transformers itself does for an unpadded prompt.

The token step (one position per row, each row masked to its own length)
runs the same modules (norms, projections, MLP; the projections in the form
:mod:`server.engine.chattts.step.linear` gave them) with the rotary embedding
applied to q and k in one pass, and its own attention: for a single query
PyTorch's CPU SDPA kernel is slow (2.8 ms for 8 rows × 12 heads × 256 positions
on one core, against 0.7 ms for two ``matmul`` and a softmax in float32,
measured with torch 2.13), so on the CPU
the step computes ``softmax(q·kᵀ·scale + mask)·v`` itself, in float32; on
CUDA it calls SDPA, whose fused kernels read the strided KV slots directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import rotate_half

#: ``attend(q, keys, values, mask, scale) -> (b, heads, 1, dim)``.
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def forward_layers(
    llama: Any, x: torch.Tensor, positions: torch.Tensor, cache: Any, mask: torch.Tensor | None
) -> torch.Tensor:
    """The Llama's layers and final norm on ``inputs_embeds`` ``x`` (what ``LlamaModel.forward`` runs)."""
    position_embeddings = llama.rotary_emb(x, positions)
    for layer in llama.layers[: llama.config.num_hidden_layers]:
        out = layer(
            x,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            position_embeddings=position_embeddings,
        )
        x = out[0] if isinstance(out, tuple) else out
    result: torch.Tensor = llama.norm(x)
    return result


def math_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Single-query attention in float32: two matmuls and a softmax (the CPU's fast path).

    The eager CPU step's KV slots are float32 already (``kv.kv_dtype``): no conversion of the
    strided slot views, which cost as much as the attention itself. Under the compiled step
    they are bf16, and inductor fuses the conversion into the reads.
    """
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
    scores = torch.where(mask, scores, float("-inf"))  # one op where ``masked_fill(~mask)`` took two
    return torch.matmul(scores.softmax(dim=-1), values.float()).to(q.dtype)


def sdpa_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """PyTorch's fused attention with a boolean mask (CUDA)."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


def attention_for(device: torch.device) -> Attention:
    """The token step's attention on ``device``."""
    return sdpa_attention if device.type == "cuda" else math_attention


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: each K/V head serves ``groups`` query heads (transformers' ``repeat_kv``)."""
    if groups == 1:
        return x
    b, heads, length, dim = x.shape
    return x[:, :, None].expand(b, heads, groups, length, dim).reshape(b, heads * groups, length, dim)


def decode_layers(
    llama: Any, x: torch.Tensor, positions: torch.Tensor, cache: Any, mask: torch.Tensor, attend: Attention
) -> torch.Tensor:
    """One position per row through every layer and the final norm; ``cache.update`` stores K/V.

    Args:
        llama: the ``LlamaModel``.
        x: ``(b, 1, hidden)`` inputs in the model's dtype.
        positions: ``(b, 1)`` each row's position.
        cache: has ``update(k, v, layer_idx) -> (keys, values)`` over the attended range.
        mask: ``(b, 1, 1, length)`` bool, True where a row may attend.
        attend: the attention function.
    """
    cos, sin = (t.unsqueeze(1) for t in llama.rotary_emb(x, positions))  # (b, 1, 1, head_dim)
    b = x.shape[0]
    for layer in llama.layers[: llama.config.num_hidden_layers]:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        heads = attn.config.num_attention_heads
        # One position per row: (b, 1, heads·dim) is (b, heads, 1, dim) as it lies in memory. The
        # rotary embedding turns q and k in one pass (the same arithmetic per element as
        # transformers' ``apply_rotary_pos_emb``, half of its operator calls).
        qk = torch.cat([attn.q_proj(h), attn.k_proj(h)], dim=-1).view(b, -1, 1, attn.head_dim)
        qk = qk * cos + rotate_half(qk) * sin  # type: ignore[no-untyped-call]
        q, k = qk[:, :heads], qk[:, heads:]
        v = attn.v_proj(h).view(b, -1, 1, attn.head_dim)
        keys, values = cache.update(k, v, attn.layer_idx)
        groups = attn.num_key_value_groups
        out = attend(q, _repeat_kv(keys, groups), _repeat_kv(values, groups), mask, attn.scaling)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, 1, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    result: torch.Tensor = llama.norm(x)
    return result
