"""What reading the GPT's weights once costs on this CPU: the floors a token step is held to.

A token step at small batches is bound by memory: every step reads every weight once. One product
over as many weights as the GPT has, in one call, is the fastest that read can be; a step's time
over it is what the step adds (its many calls, attention, the rest).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from server.engine.chattts.step import w8a8_vnni
from server.engine.chattts.step.linear import PackedLinear
from server.engine.chattts.step.w8a8 import cpu_has_vnni, quantized_engine_available


def floor(weights: int, batch: int, hidden: int) -> dict[str, Callable[[], None]]:
    """One bf16 product over ``weights`` parameters, plain and packed."""
    w = torch.randn(weights // hidden, hidden, dtype=torch.bfloat16)
    packed = PackedLinear(w)
    x = torch.randn(batch, hidden, dtype=torch.bfloat16)
    return {"plain": lambda: F.linear(x, w), "packed": lambda: packed(x)}


def int8_floor(weights: int, hidden: int) -> dict[str, Callable[[int], Callable[[], torch.Tensor]]]:
    """One w8a8 product over ``weights`` int8 parameters by kernel: ``{"fbgemm": floor(batch), ...}``.

    ``fbgemm``: FBGEMM's dynamic int8 product as :class:`~server.engine.chattts.step.w8a8.W8A8Linear`
    calls it (per-channel int8 weights, each call quantizing its float32 rows); ``vnni``: this
    project's kernel (:mod:`server.engine.chattts.step.w8a8_vnni`), where the CPU has
    AVX512-VNNI. Each over one matrix packed once: the same weight bytes as the GPT's, read
    once per call. The floor is the faster of the two, as the bf16 floor is the faster of its
    two forms. Empty where neither runs.
    """
    rows = weights // hidden
    kernels: dict[str, Callable[[int], Callable[[], torch.Tensor]]] = {}
    if quantized_engine_available():
        w = torch.randn(rows, hidden)
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8).double()
        q = torch.quantize_per_channel(w, scale, torch.zeros(rows, dtype=torch.long), 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(q, None)
        del w, q
        reduce_range = not cpu_has_vnni()

        def fbgemm(batch: int) -> Callable[[], torch.Tensor]:
            x = torch.randn(batch, hidden)
            return lambda: torch.ops.quantized.linear_dynamic(x, packed, reduce_range)

        kernels["fbgemm"] = fbgemm
    if w8a8_vnni.available():
        vnni_module = w8a8_vnni.VnniLinear(torch.randn(rows, hidden))

        def vnni(batch: int) -> Callable[[], torch.Tensor]:
            x = torch.randn(batch, hidden)
            return lambda: vnni_module(x)

        kernels["vnni"] = vnni
    return kernels
