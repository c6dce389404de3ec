"""The Llama's projections as the token step wants them: oneDNN-prepacked bf16, or weight-only int8.

A token step is seven matrix products per layer (q, k, v, o, gate, up, down: 140 for
ChatTTS's 20 layers) over one row per stream, so on a CPU it is bound by reading the
weights. ``F.linear`` on bf16 weights hands oneDNN a plain row-major matrix on every
call, which it reorders into its blocked layout each time; :class:`PackedLinear` keeps
the weight in that layout once (``torch.ops.mkldnn._reorder_linear_weight``, what
inductor's ``freezing`` does for compiled models) and calls the same kernel on it:
about 1.5x faster for the 140 products at batch 1 to 8 on this project's CPU, with the
same results as ``F.linear`` (``bench/results/cpu/xeon-2core.md``). Fusing q/k/v and
gate/up into larger products gained nothing measurable on top of it, so the modules
keep their shapes and the prefill and refinement (transformers' own layers) run on the
same single copy of the weights.

:class:`Int8Linear` is the opt-in ``--quantize int8``: weights in int8 with one scale
per output channel, activations untouched (weight-only), computed by
``torch.ops.aten._weight_int8pack_mm`` where the device has it (the CPU) for up to
:data:`INT8_KERNEL_MAX_ROWS` rows, and by dequantizing into the activation dtype for
more rows (a prefill) or on other devices (correct and capturable, not faster).
It halves what a bf16 step reads; it changes the sampled tokens (docs/operations.md,
"Run on a CPU"). ``--quantize w8a8`` (:class:`~server.engine.chattts.step.w8a8.W8A8Linear`)
multiplies int8 by int8 instead, the fastest form on a CPU at every batch.

Float32 on the CPU and every dtype on CUDA keep transformers' ``nn.Linear`` (MKL and
cuBLAS already read their plain layout well; float32 must stay token-identical to
ChatTTS).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from server.engine.chattts.options import QUANTIZE_CHOICES
from server.engine.chattts.step.int8 import quantize_int8
from server.engine.chattts.step.w8a8 import grouped_modules, quantized_engine_available, w8a8_kernel

log = logging.getLogger(__name__)

#: Above this many rows a product dequantizes the int8 weight instead of calling
#: ``_weight_int8pack_mm``, whose cost grows with the rows (a matrix-vector kernel: 4x a
#: dequantized product at 256 rows, measured with torch 2.13 on this project's CPU).
INT8_KERNEL_MAX_ROWS = 16

#: The projections of one transformers ``LlamaDecoderLayer``: (sub-module, attribute).
PROJECTIONS = (
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
)


def onednn_packing_available() -> bool:
    """Whether this PyTorch build has oneDNN's prepacked linear (CPU builds normally do)."""
    mkldnn = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available()) and all(  # type: ignore[no-untyped-call]
        hasattr(mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """``nn.Linear`` without bias whose weight lives in oneDNN's blocked layout (bf16, CPU).

    Args:
        weight: ``(out, in)`` bf16 on the CPU.
        batch_hint: the row count oneDNN chooses its blocking for (any count works).
    """

    def __init__(self, weight: torch.Tensor, *, batch_hint: int = 8) -> None:
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        # A plain attribute, not a buffer: an opaque oneDNN tensor cannot be moved or saved.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` for ``(..., in)`` inputs."""
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return out

    def extra_repr(self) -> str:
        """What ``print(module)`` shows."""
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn-packed"


class Int8Linear(nn.Module):
    """Weight-only int8 ``nn.Linear`` without bias: int8 weight, one scale per output channel.

    ``scale`` is a floating buffer, so ``module.to(dtype=...)`` gives it the activations'
    dtype (what ``_weight_int8pack_mm`` wants) while the int8 weight stays int8.
    """

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        q, scale = quantize_int8(weight)
        self.register_buffer("qweight", q.to(weight.device))
        self.register_buffer("scale", scale.to(weight.device))
        self._packed_mm = torch._C._dispatch_has_kernel_for_dispatch_key(
            "aten::_weight_int8pack_mm", "CUDA" if weight.device.type == "cuda" else "CPU"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ (q · scale).T`` for ``(..., in)`` inputs."""
        qweight, scale = self.qweight, self.scale
        flat = x.reshape(-1, self.in_features)
        if self._packed_mm and flat.shape[0] <= INT8_KERNEL_MAX_ROWS:
            out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(flat, qweight, scale.to(x.dtype))
            return out.view(*x.shape[:-1], self.out_features)
        # Many rows (a prompt's prefill): the int8 kernel costs in proportion to the rows, while
        # one dequantized copy of the weight serves them all.
        return F.linear(x, qweight.to(x.dtype) * scale.to(x.dtype).unsqueeze(1))

    def extra_repr(self) -> str:
        """What ``print(module)`` shows."""
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight-only"


def prepare_projections(
    llama: nn.Module, *, dtype: torch.dtype, device: torch.device, quantize: str, compiled: bool = False
) -> str:
    """Cast the Llama to ``dtype`` and give its projections the step's best form; what they became.

    ``compiled``: the step will be compiled on the CPU (``--compile-step on``), whose compiler
    packs bf16 weights itself and cannot trace :class:`PackedLinear`: they stay ``nn.Linear``.

    Returns:
        ``"int8"`` (:class:`Int8Linear`), ``"w8a8"`` (:func:`w8a8_layer`), ``"onednn-bf16"``
        (:class:`PackedLinear`, bf16 on a CPU whose PyTorch has oneDNN) or ``"dense"``
        (transformers' own ``nn.Linear``).

    Raises:
        ValueError: ``w8a8`` off the CPU or on a PyTorch without FBGEMM.
    """
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}; not {quantize!r}")
    layers = list(llama.layers)  # type: ignore[arg-type]
    if quantize == "w8a8":
        if device.type != "cpu" or not quantized_engine_available():
            raise ValueError("--quantize w8a8 runs on an x86-64 CPU only (FBGEMM); use int8 or none here")
        _replace_layers(layers, w8a8_layer)  # from the loaded (float32) weights, before the cast
        llama.to(dtype=dtype)
        log.info("w8a8 products: %s", "this project's VNNI kernel" if w8a8_kernel() == "vnni" else "FBGEMM")
        return "w8a8"
    if quantize == "int8":  # from the loaded (float32) weights, before the cast
        _replace(layers, Int8Linear)
        llama.to(dtype=dtype)
        return "int8"
    llama.to(dtype=dtype)
    pack = device.type == "cpu" and dtype == torch.bfloat16 and not compiled
    if pack and onednn_packing_available():
        _replace(layers, PackedLinear)
        return "onednn-bf16"
    return "dense"


def w8a8_layer(weights: list[torch.Tensor]) -> list[nn.Module]:
    """One layer's seven projections (weights in :data:`PROJECTIONS` order) as ``--quantize w8a8`` makes them.

    q/k/v and gate/up become one product each (:func:`~.w8a8.grouped_modules`).
    """
    by_name = grouped_modules({name: w for (_, name), w in zip(PROJECTIONS, weights, strict=True)})
    return [by_name[name] for _, name in PROJECTIONS]


def _replace(layers: list[nn.Module], make: Callable[[torch.Tensor], nn.Module]) -> None:
    """Every layer's seven projections replaced by ``make(weight)``; the dense weights are freed."""
    _replace_layers(layers, lambda weights: [make(w) for w in weights])


def _replace_layers(
    layers: list[nn.Module], make_layer: Callable[[list[torch.Tensor]], list[nn.Module]]
) -> None:
    """Every layer's seven projections replaced by ``make_layer(their weights)``; the dense weights are freed.

    Weights and modules are in :data:`PROJECTIONS` order; a layer is checked whole before it changes.
    """
    for layer in layers:
        places = [(getattr(layer, owner_name), owner_name, name) for owner_name, name in PROJECTIONS]
        weights = []
        for owner, owner_name, name in places:
            linear = getattr(owner, name)
            if not isinstance(linear, nn.Linear) or getattr(linear, "bias", None) is not None:
                raise TypeError(f"{owner_name}.{name} is {type(linear).__name__}, not a Linear without bias")
            weights.append(linear.weight)
        with torch.no_grad():
            modules = make_layer(weights)
        for (owner, _, name), module in zip(places, modules, strict=True):
            setattr(owner, name, module)
