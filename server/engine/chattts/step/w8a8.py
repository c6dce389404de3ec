"""``--quantize w8a8``: int8 weights and int8 activations, each activation row on its own scale (CPU).

A token step on a small CPU is bound by reading the GPT's weights, and weight-only int8
(:class:`~server.engine.chattts.step.linear.Int8Linear`) halves the bytes but not the time:
``_weight_int8pack_mm`` converts every weight to floating point before it multiplies, and its
cost grows with the rows (on this project's 2-core EPYC, the 140 products took 17.6 ms at
batch 1 and 39.0 ms at batch 8, against 24.5 and 24.4 ms in prepacked bf16). FBGEMM's
dynamically quantized linear (``quantized::linear_dynamic``) multiplies int8 by int8 with
integer instructions (VNNI where the CPU has it) and reads the int8 weight once for all rows:
14.7 ms at batch 1 and 20.3 ms at batch 8 in the same run, grouped as below
(``git show fc4c6cc:bench/results/cpu_realtime_epyc_5b9b7af.md``; the bare FBGEMM calls alone took
7.6 and 10.5 ms in a quieter hour).

Its one flaw for a server: it quantizes its whole input with one scale, so a row's result
depends on the other rows of the batch (a loud row leaves a quiet one a few levels, up to 100 %
error), and a stream's tokens would depend on who else is speaking. :class:`W8A8Linear`
removes that: each row is divided by its own largest magnitude (so every row spans [-1, 1]),
one anchor row holding exactly +1 and -1 is appended (so the tensor's range, and with it the
quantization grid, is [-1, 1] whatever the batch holds), and each output row is multiplied back
by its row's magnitude. The products are exact integer sums, so a row's output is bit-for-bit
the same alone or in any batch (a test holds it to that), and its error is per-row int8
rounding (about 1 % of the output's norm, against 0.5 % for weight-only int8).

Each product also costs about ten small operators around the FBGEMM call (the row
magnitudes, the anchor, the conversions), which at batch 1 took as long as the product
itself. So the projections that read one input are one product: q, k and v of a layer are
one :class:`W8A8Group`, and so are gate and up (4 products a layer instead of 7). Their
modules keep transformers' names and shapes (:class:`GroupMember`), so the prefill, the
refinement and the step still call ``q_proj(h)``, ``k_proj(h)``, ``v_proj(h)``: the first
call computes all three, the others take their part of it. Every output channel is quantized
and summed exactly as it would be alone, so the parts are bit-for-bit the separate products.

Under ``--compile-step on`` the same products run inside inductor's compiled step: dynamo
cannot trace FBGEMM's packed weight (an opaque object), so the compiled step calls FBGEMM through
one operator of this project's own (``chattts_stream::w8a8_rows``), which names the module by a
handle, and inductor fuses the small operators around it (the row magnitudes, the division, the
anchor, the rescaling) with the norms and residuals it already fuses. The products are the same
calls on the same packed weights; only the fused arithmetic around them may round differently.
The whole step then took 14.3 / 21.0 / 29.2 ms at batch 1 / 4 / 8, against 24.2 / 33.9 / 45.9
eager (``git show 6ad7ebf:bench/results/cpu_realtime_epyc_3d46d1e.md``; today's run on the same
kind of CPU: ``bench/results/cpu/epyc-2core.md``).

Where the CPU has AVX512-VNNI, :func:`w8a8_product` takes this project's own kernel instead of
FBGEMM (:mod:`.w8a8_vnni`: the same per-row and per-channel quantization, each row quantized
inside the kernel, the weights read once in a layout made for VNNI); the grouping above is
the same for both.

It changes tokens, so it is an opt-in like ``int8`` (docs/operations.md, "Run on a CPU", says
what it costs in code agreement with float32). It runs on the CPU only, where PyTorch has FBGEMM
(x86-64); the server refuses it elsewhere at start-up.
"""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from server.engine.chattts.step import cpu, w8a8_vnni


def quantized_engine_available() -> bool:
    """Whether this PyTorch can run FBGEMM's dynamic int8 linear (x86-64 builds can)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_dynamic"
    )


@functools.cache
def cpu_has_vnni() -> bool:
    """Whether the CPU multiplies u8·s8 into int32 without an int16 step (AVX512-VNNI or AVX-VNNI).

    Without it FBGEMM's u8·s8 instructions add pairs of products in 16 bits, which saturates
    unless activations use 7 bits (``reduce_range``); with it the full 8 bits are safe.
    """
    flags = cpu.flags() or frozenset()  # not Linux: the safe 7 bits
    return "avx512_vnni" in flags or "avx_vnni" in flags


def _per_channel_int8(weight: torch.Tensor) -> torch.Tensor:
    """The symmetric per-output-channel qint8 tensor FBGEMM packs (the rounding of ``int8.quantize_int8``)."""
    w = weight.detach().float().cpu()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    zero_points = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # PyTorch marks quantized tensors as deprecated (pytorch#184982); FBGEMM's packed linear still
        # takes one as its input, and quantized_engine_available() is checked before this runs.
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.quantize_per_channel(w, scale.double(), zero_points, 0, torch.qint8)


#: Every live :class:`W8A8Linear` by its handle; a module that is collected leaves by itself.
_BY_HANDLE: weakref.WeakValueDictionary[int, W8A8Linear] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()

#: The compiled step's door to FBGEMM: ``w8a8_rows(rows, handle)`` is ``linear_dynamic`` of the
#: normalized rows (anchor included) with the packed weight of module ``handle``. An operator
#: dynamo treats as opaque, because the packed weight itself cannot be traced.
_LIBRARY = torch.library.Library("chattts_stream", "DEF")  # type: ignore[no-untyped-call]
_LIBRARY.define("w8a8_rows(Tensor rows, int handle) -> Tensor")  # type: ignore[no-untyped-call]


def _w8a8_rows(rows: torch.Tensor, handle: int) -> torch.Tensor:
    return _BY_HANDLE[handle].product(rows)


def _w8a8_rows_shape(rows: torch.Tensor, handle: int) -> torch.Tensor:
    """What the compiler sees: ``(rows, out_features)`` float32."""
    return rows.new_empty((rows.shape[0], _BY_HANDLE[handle].out_features), dtype=torch.float32)


_LIBRARY.impl("w8a8_rows", _w8a8_rows, "CPU")  # type: ignore[no-untyped-call]
torch.library.register_fake("chattts_stream::w8a8_rows", _w8a8_rows_shape, lib=_LIBRARY)


class W8A8Linear(nn.Module):
    """``nn.Linear`` without bias as FBGEMM's int8 × int8 product, each input row quantized on its own scale.

    Args:
        weight: ``(out, in)`` weights (any float dtype; quantized per output channel).
        reduce_range: quantize activations to 7 bits (default: unless the CPU has VNNI).
    """

    def __init__(self, weight: torch.Tensor, *, reduce_range: bool | None = None) -> None:
        super().__init__()
        if not quantized_engine_available():
            raise RuntimeError("this PyTorch has no FBGEMM dynamic int8 linear (x86-64 CPU builds do)")
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.reduce_range = not cpu_has_vnni() if reduce_range is None else reduce_range
        # A plain attribute, not a buffer: FBGEMM's packed weight is an opaque object.
        self.packed = torch.ops.quantized.linear_prepack(_per_channel_int8(weight), None)
        anchor = torch.zeros(1, self.in_features)
        anchor[0, 0], anchor[0, -1] = 1.0, -1.0
        self._anchor = anchor  # fixes the input's range at [-1, 1]: the grid no longer depends on the batch
        self.handle = next(_HANDLES)
        _BY_HANDLE[self.handle] = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` for ``(..., in)`` inputs, in ``x``'s dtype."""
        flat = x.reshape(-1, self.in_features).float()
        magnitude = flat.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        rows = torch.cat([flat / magnitude, self._anchor])
        out: torch.Tensor
        if torch.compiler.is_compiling():  # the same product, through an operator dynamo can hold
            out = torch.ops.chattts_stream.w8a8_rows(rows, self.handle)
        else:
            out = self.product(rows)
        return (out[:-1] * magnitude).to(x.dtype).view(*x.shape[:-1], self.out_features)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """FBGEMM's product of normalized ``(n, in)`` float32 rows, anchor row included: ``(n, out)``."""
        out: torch.Tensor = torch.ops.quantized.linear_dynamic(rows, self.packed, self.reduce_range)
        return out

    def extra_repr(self) -> str:
        """What ``print(module)`` shows."""
        bits = 7 if self.reduce_range else 8
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a{bits} per-row"


class W8A8Group:
    """Projections of one input as one :class:`W8A8Linear` over their stacked weights.

    :meth:`output` computes the whole product on the first call for an input and keeps its
    parts until each member has taken its own (then lets go of them and of the input, so a
    prefill's large outputs are not held until the next step). The input is held by reference
    while the parts are kept, so its identity cannot be reused by another tensor, and its
    version counter catches an in-place change (an inference-mode tensor has none: there the
    callers' contract holds, transformers' attention and MLP and the token step pass the same
    unchanged input to every member).

    Args:
        weights: the members' ``(out_i, in)`` weights, in member order.
        reduce_range: as :class:`W8A8Linear`'s.
        kernel: as :func:`w8a8_product`'s.
    """

    def __init__(
        self, weights: Sequence[torch.Tensor], *, reduce_range: bool | None = None, kernel: str = "auto"
    ) -> None:
        self.sizes = [int(w.shape[0]) for w in weights]
        self.product = w8a8_product(
            torch.cat([w.detach() for w in weights]), reduce_range=reduce_range, kernel=kernel
        )
        self._input: torch.Tensor | None = None
        self._version = -1
        self._parts: list[torch.Tensor | None] = [None] * len(self.sizes)

    def output(self, member: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``member``'s product with ``x`` (computed with the others' if ``x`` is new)."""
        part = self._parts[member]
        if part is None or x is not self._input or _version(x) != self._version:
            self._parts = list(self.product(x).split(self.sizes, dim=-1))
            self._input, self._version = x, _version(x)
            part = self._parts[member]
        self._parts[member] = None
        if all(p is None for p in self._parts):
            self._input = None
        assert part is not None
        return part


def _version(x: torch.Tensor) -> int:
    """``x``'s in-place version counter, or -1 for an inference-mode tensor (which has none).

    Also -1 while dynamo traces the compiled step: it cannot trace ``is_inference()`` (a graph
    break), and within one traced graph the identity of ``x`` is all there is to check.
    """
    return -1 if torch.compiler.is_compiling() or x.is_inference() else int(x._version)


class GroupMember(nn.Module):
    """One projection of a :class:`W8A8Group`, where transformers' layer has its ``nn.Linear``."""

    def __init__(self, group: W8A8Group, member: int) -> None:
        super().__init__()
        self.group, self.member = group, member
        self.in_features = group.product.in_features
        self.out_features = group.sizes[member]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` for ``(..., in)`` inputs (a view of the group's product)."""
        return self.group.output(self.member, x)

    def extra_repr(self) -> str:
        """What ``print(module)`` shows."""
        form = self.group.product.extra_repr().rsplit(", ", 1)[-1]
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, member {self.member} of {len(self.group.sizes)} ({form})"


#: The projections that share an input: one product each group.
SHARED_INPUTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
#: The projections with an input of their own.
ALONE = ("o_proj", "down_proj")


#: The product's kernels: ``vnni`` (:mod:`.w8a8_vnni`, where the CPU has AVX512-VNNI), ``fbgemm``.
KERNELS = ("auto", "vnni", "fbgemm")


def w8a8_kernel() -> str:
    """The kernel :func:`w8a8_product` takes by default in this process: ``vnni`` or ``fbgemm``."""
    return "vnni" if w8a8_vnni.available() else "fbgemm"


def w8a8_product(
    weight: torch.Tensor, *, reduce_range: bool | None = None, kernel: str = "auto"
) -> W8A8Linear | w8a8_vnni.VnniLinear:
    """One w8a8 product of ``(out, in)`` weights: the VNNI kernel where it runs (``auto``), else FBGEMM.

    ``reduce_range`` applies to FBGEMM only (the VNNI kernel's byte products never saturate).
    """
    if kernel not in KERNELS:
        raise ValueError(f"w8a8 kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "vnni" or (kernel == "auto" and reduce_range is None and w8a8_kernel() == "vnni"):
        return w8a8_vnni.VnniLinear(weight)
    return W8A8Linear(weight, reduce_range=reduce_range)


def grouped_modules(weights: Mapping[str, torch.Tensor], kernel: str = "auto") -> dict[str, nn.Module]:
    """The seven projections as modules by name (``q_proj`` … ``down_proj``) from their weights."""
    modules: dict[str, nn.Module] = {}
    with torch.no_grad():
        for names in SHARED_INPUTS.values():
            group = W8A8Group([weights[name] for name in names], kernel=kernel)
            modules.update({name: GroupMember(group, member) for member, name in enumerate(names)})
        for name in ALONE:
            modules[name] = w8a8_product(weights[name], kernel=kernel)
    return modules
