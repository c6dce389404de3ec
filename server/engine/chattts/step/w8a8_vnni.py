"""``--quantize w8a8`` on a CPU with AVX512-VNNI: the products as one C++ kernel of this project's own.

At a token step's few rows, FBGEMM's int8 product (:class:`~.w8a8.W8A8Linear`) reads a
layer's weights well below the memory's speed: the 80 products of a batch-1 step took
7.6 ms on this project's 2-core EPYC against 5.5 ms for FBGEMM reading as many weights in one
product, and each product also costs a Python operator and the small operators of its
anchor row (``bench/results/cpu/defaults-epyc-2core.md``). ``chattts_stream::w8a8_vnni``
(``csrc/w8a8_vnni.cpp``) computes the same kind of product (int8 weights quantized per output
channel, each activation row quantized on its own scale, exact integer sums) in one pass over
weights laid out for VNNI's byte products: 5.3 ms for the 80 products in the same run, and
reading 190 MB of int8 weights in one product took it 4.0 ms. Up to four rows read each weight
from memory once; more rows go four at a time, the weights then coming from the core's cache.

It is a tensor operator (the weights are buffers, not an opaque object), so the compiled step
calls it without a Python hop, and a row's quantization happens inside it: a row's output is
bit-for-bit the same alone or in any batch, eager or compiled.

Rounding differs from FBGEMM's (a symmetric grid of 255 levels per row, against FBGEMM's 256
on the anchored [-1, 1] range), so the two kernels' tokens differ as two quantizations do;
each stays within int8 rounding of the float product (tests hold both to the same bound).
Used where the CPU has AVX512-VNNI and the kernel builds (:func:`available`); elsewhere the
server keeps FBGEMM. It is built like the decode attention
(:func:`~.decode_attention.build`: cached, serialized, a failure logged once).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

from server.engine.chattts.step import cpu, decode_attention
from server.engine.chattts.step.int8 import quantize_int8

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "w8a8_vnni.cpp"
NAME = "chattts_stream_w8a8_vnni"
OPERATOR = "chattts_stream::w8a8_vnni"
#: Output channels per group of the packed layout (``kGroup`` in the kernel).
GROUP = 64

_lock = threading.Lock()
_state: dict[str, bool] = {}


def cpu_has_avx512_vnni() -> bool:
    """Whether the CPU has AVX512-VNNI (and with it AVX512-BW), which the kernel is written for."""
    return {"avx512_vnni", "avx512bw"} <= (cpu.flags() or frozenset())


def load() -> bool:
    """Build (or load from the cache) and register the operator; False, logged, where it cannot be."""
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = decode_attention.build(SOURCE, NAME)
            if _state["loaded"]:
                _register_fake()
        return _state["loaded"]


def available() -> bool:
    """Whether this process multiplies w8a8 with the VNNI kernel: the CPU has it and the kernel built."""
    return cpu_has_avx512_vnni() and load()


def _register_fake() -> None:
    """Shapes for tracing: ``(rows, out_features)`` float32."""

    @torch.library.register_fake(OPERATOR)  # type: ignore[untyped-decorator]
    def _fake(
        x: torch.Tensor, packed: torch.Tensor, colsum: torch.Tensor, scale: torch.Tensor, out_features: int
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], out_features), dtype=torch.float32)


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's weights from ``(out, in)`` float ones: ``(packed, colsum, scale)``.

    Each output channel is quantized symmetrically on its own scale
    (:func:`~.int8.quantize_int8`, the rounding FBGEMM's weights get too), then padded with
    zero weights to whole groups of 64 channels and whole fours of inputs, and laid out as the
    kernel reads it.
    """
    q, scale = quantize_int8(weight.detach().cpu())
    out_features, in_features = q.shape
    colsum = q.sum(dim=1, dtype=torch.int32)
    rows, inputs = -(-out_features // GROUP) * GROUP, -(-in_features // 4) * 4
    padded = torch.zeros(rows, inputs, dtype=torch.int8)
    padded[:out_features, :in_features] = q
    packed = padded.view(rows // GROUP, GROUP, inputs // 4, 4).permute(0, 2, 1, 3).contiguous()
    return packed, colsum.contiguous(), scale.contiguous()


class VnniLinear(nn.Module):
    """``nn.Linear`` without bias as the VNNI kernel's int8 × int8 product, each input row on its own scale.

    Args:
        weight: ``(out, in)`` weights (any float dtype; quantized per output channel).
    """

    packed: torch.Tensor
    colsum: torch.Tensor
    scale: torch.Tensor

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        if not available():
            raise RuntimeError("the w8a8 VNNI kernel needs an x86-64 CPU with AVX512-VNNI and a C++ compiler")
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        packed, colsum, scale = pack(weight)
        # Buffers, not parameters: what the compiled step reads, never trained, kept off state_dict.
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("colsum", colsum, persistent=False)
        self.register_buffer("scale", scale, persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> VnniLinear:
        """``module.to(...)`` and kin, except that the channel scales stay float32.

        The engine casts the whole Llama to its dtype after the projections are replaced, and
        a cast applies to every floating-point buffer; the kernel's epilogue reads float32.
        """
        scale = self.scale
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        self.scale = scale.to(device=self.packed.device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` for ``(..., in)`` inputs, in ``x``'s dtype."""
        flat = x.reshape(-1, self.in_features)
        out: torch.Tensor = torch.ops.chattts_stream.w8a8_vnni(
            flat, self.packed, self.colsum, self.scale, self.out_features
        )
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        """What ``print(module)`` shows."""
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8 per-row (VNNI)"
