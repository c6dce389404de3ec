"""The w8a8 products' VNNI kernel (``chattts_stream::w8a8_vnni``, issue #46).

* it is exact integer arithmetic: every output equals, bit for bit, the documented
  quantization (each row on its own symmetric grid, each channel on its own) summed in
  integers and scaled in float32, for shapes that fill no whole group of 64 channels or four
  inputs, for one to three hundred rows (every tile the kernel has), float32 and bfloat16 input;
* a row's output is the same alone or in any batch, eager or compiled (no graph break);
* it stays within int8 rounding of the float product, as FBGEMM's form does;
* ``auto`` takes it where it runs, FBGEMM where asked (or for 7-bit activations), and the
  engine's cast to bfloat16 leaves its channel scales float32.
"""

from __future__ import annotations

import pytest
import torch

from server.engine.chattts.step import w8a8_vnni
from server.engine.chattts.step.w8a8 import W8A8Group, W8A8Linear, grouped_modules, w8a8_product
from server.engine.chattts.step.w8a8_vnni import VnniLinear
from tests.model.helpers import TEST_DEVICE

pytestmark = pytest.mark.skipif(
    TEST_DEVICE != "cpu" or not w8a8_vnni.available(), reason="an x86-64 CPU with AVX512-VNNI"
)

#: Rows of very different loudness, an outlier, an all-zero row.
LOUDNESS = (0.01, 1.0, 100.0, 3.0, 0.0, 7.0)


def _weight(out: int, width: int) -> torch.Tensor:
    torch.manual_seed(2)
    return torch.randn(out, width) * torch.linspace(0.002, 0.05, out).unsqueeze(1)


def _rows(count: int, width: int) -> torch.Tensor:
    torch.manual_seed(count)
    loud = torch.tensor([LOUDNESS[i % len(LOUDNESS)] for i in range(count)])
    x = torch.randn(count, width) * loud.unsqueeze(1)
    if count > 3:
        x[3, width // 2] = 80.0
    return x


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in torch: row and channel symmetric int8, integer sums, float32 scaling."""
    x = x.float()
    largest = x.abs().amax(dim=1, keepdim=True)
    row_scale = largest / 127
    # 127 / largest would be reciprocal(largest) * 127 (torch's __rtruediv__): one division, as the kernel
    inverse = torch.where(largest > 0, torch.full_like(largest, 127.0) / largest, 0.0)
    q = torch.round(x * inverse).clamp(-127, 127).long()
    channel_scale = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    wq = torch.round(weight / channel_scale.unsqueeze(1)).clamp(-127, 127).long()
    sums = (q @ wq.T).float()  # exact in int64, then the kernel's one rounding to float32
    return sums * (channel_scale.unsqueeze(0) * row_scale)


@pytest.mark.parametrize("shape", [(96, 64), (130, 770), (5, 7), (2304, 768), (768, 3072)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 13, 300])
def test_the_kernel_is_exact_integer_arithmetic(shape: tuple[int, int], rows: int) -> None:
    out_features, width = shape
    weight = _weight(out_features, width)
    module = VnniLinear(weight)
    x = _rows(rows, width)
    assert torch.equal(module(x), _reference(x, weight))
    bf16 = x.to(torch.bfloat16)
    got = module(bf16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, _reference(bf16, weight).to(torch.bfloat16))


def test_a_row_is_the_same_alone_or_in_any_batch_eager_or_compiled() -> None:
    module = VnniLinear(_weight(96, 64))
    x = _rows(12, 64)
    compiled = torch.compile(module, dynamic=True, fullgraph=True)  # fullgraph: a graph break raises
    with torch.no_grad():
        together = module(x)
        assert torch.equal(compiled(x), together)
        for i in range(len(x)):
            alone = x[i : i + 1]
            assert torch.equal(module(alone), together[i : i + 1]), f"row {i} depends on its batch"
            assert torch.equal(compiled(alone), together[i : i + 1])
        assert torch.equal(module(x[[2, 0]])[1], together[0])


def test_every_row_stays_within_int8_rounding_of_the_float_product() -> None:
    weight = _weight(96, 64)
    x = _rows(6, 64)
    x = x[[i for i in range(len(x)) if x[i].abs().max() > 0]]  # a zero row has no relative error
    exact = x @ weight.T
    for module in (VnniLinear(weight), W8A8Linear(weight, reduce_range=False)):
        error = (module(x) - exact).norm(dim=1) / exact.norm(dim=1)
        assert torch.all(error < 0.03), (module, error)
    assert VnniLinear(weight)(x.view(1, len(x), 64)).shape == (1, len(x), 96)


def test_auto_takes_the_kernel_where_it_runs_and_fbgemm_where_asked() -> None:
    weight = _weight(96, 64)
    assert isinstance(w8a8_product(weight), VnniLinear)
    assert isinstance(w8a8_product(weight, kernel="fbgemm"), W8A8Linear)
    assert isinstance(w8a8_product(weight, reduce_range=True), W8A8Linear)  # 7 bits: FBGEMM's option
    with pytest.raises(ValueError, match="kernel"):
        w8a8_product(weight, kernel="fastest")
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    modules = grouped_modules({n: _weight(64, 64) for n in names})
    assert isinstance(modules["o_proj"], VnniLinear)
    assert isinstance(modules["q_proj"].group.product, VnniLinear)
    fbgemm = grouped_modules({n: _weight(64, 64) for n in names}, kernel="fbgemm")
    assert isinstance(fbgemm["down_proj"], W8A8Linear)
    group = W8A8Group([_weight(96, 64), _weight(32, 64)])
    x = _rows(5, 64)
    assert torch.equal(group.output(1, x), VnniLinear(_weight(32, 64))(x))


def test_a_cast_to_bfloat16_keeps_the_channel_scales_float32() -> None:
    """The engine casts the Llama to bf16 after replacing its projections; the kernel reads float32 scales."""
    weight = _weight(96, 64)
    module = VnniLinear(weight)
    x = _rows(4, 64).to(torch.bfloat16)
    before = module(x)
    module.to(dtype=torch.bfloat16)
    assert module.scale.dtype == torch.float32 and module.packed.dtype == torch.int8
    assert torch.equal(module(x), before)
