"""Per-output-channel int8 weights: the one rounding every int8 form of the projections shares.

Weight-only int8 (:class:`~.linear.Int8Linear`) and the w8a8 VNNI kernel
(:mod:`.w8a8_vnni`) quantize their weights with it; FBGEMM's packed weights
(:mod:`.w8a8`) are rounded the same way.
"""

from __future__ import annotations

import torch


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``(q (out, in) int8, scale (out,) float32)``, ``w ≈ q · scale``."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale
