"""``--quantize w8a8`` (issue #23): int8 weights times int8 activations, each row on its own scale.

* a row's output is bit-for-bit the same alone or beside any other rows (the anchor row and
  the per-row magnitudes are what make it so: FBGEMM alone quantizes the whole batch on one
  grid, and a loud row then erases a quiet one);
* every row stays within int8 rounding of the float product, however loud its neighbours;
* projections of one input (q/k/v, gate/up) run as one product, and each member's part is
  bit-for-bit its own product; the group lets go of its parts once every member took its own;
* through the engine, a stream's tokens do not depend on who else is in the batch;
* under ``--compile-step on`` the same products run inside inductor's graph (no graph break),
  a row is still the same alone or in any batch, and the compiled step gives the eager w8a8
  step's tokens with rows joining and leaving
  (``test_step_forms.test_the_compiled_step_gives_the_same_tokens_as_the_eager_step``);
* where the CPU has AVX512-VNNI the products are this project's kernel instead
  (``test_w8a8_vnni.py``); the engine's stream is then as batch-independent;
* it is refused where it cannot run (off the CPU); the server with it streams and says so
  (``test_step_forms.test_a_quantized_server_streams_and_says_so``).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from server.engine.chattts.options import EngineOptions
from server.engine.chattts.step import linear, w8a8, w8a8_vnni
from server.engine.chattts.step.w8a8 import (
    GroupMember,
    W8A8Group,
    W8A8Linear,
    grouped_modules,
    quantized_engine_available,
)
from server.engine.chattts.step.w8a8_vnni import VnniLinear
from server.engine_api import SequenceRequest, SynthesisParams
from tests.model.helpers import TEST_DEVICE, step_until_finished

pytestmark = pytest.mark.skipif(
    TEST_DEVICE != "cpu" or not quantized_engine_available(), reason="w8a8 is FBGEMM's, on an x86-64 CPU"
)

#: Rows of very different loudness, one with an outlier, one all positive, one all negative:
#: on one shared grid the quiet rows would round to almost nothing.
LOUDNESS = (0.01, 1.0, 100.0, 3.0, 0.5, 7.0)


def _rows(width: int) -> torch.Tensor:
    torch.manual_seed(1)
    x = torch.randn(len(LOUDNESS), width) * torch.tensor(LOUDNESS).unsqueeze(1)
    x[3, 5] = 80.0  # an outlier channel
    x[4] = x[4].abs()  # a row whose range is [0, max]: its own grid would differ without the anchor
    x[5] = -x[5].abs()
    return x


def _weight(out: int, width: int) -> torch.Tensor:
    torch.manual_seed(2)
    return torch.randn(out, width) * torch.linspace(0.002, 0.05, out).unsqueeze(1)


@pytest.mark.parametrize("reduce_range", [True, False])
def test_a_row_is_the_same_alone_or_in_any_batch(reduce_range: bool) -> None:
    module = W8A8Linear(_weight(96, 64), reduce_range=reduce_range)
    x = _rows(64)
    together = module(x)
    for i in range(len(x)):
        assert torch.equal(module(x[i : i + 1]), together[i : i + 1]), f"row {i} depends on its batch"
    assert torch.equal(module(x[[2, 0]])[1], together[0])  # a quiet row beside the loudest, in any order
    many = torch.cat([x, torch.randn(300, 64) * 50])  # a prefill's many rows
    assert torch.equal(module(many)[: len(x)], together)


@pytest.mark.parametrize("reduce_range", [True, False])
def test_every_row_stays_within_int8_rounding_of_the_float_product(reduce_range: bool) -> None:
    weight = _weight(96, 64)
    module = W8A8Linear(weight, reduce_range=reduce_range)
    x = _rows(64)
    exact = x @ weight.T
    error = (module(x) - exact).norm(dim=1) / exact.norm(dim=1)
    bound = 0.05 if reduce_range else 0.03  # 7 or 8 bits of activation, 8 bits of weight
    assert torch.all(error < bound), error
    assert module(x.view(2, 3, 64)).shape == (2, 3, 96)
    bf16 = module(x.to(torch.bfloat16))  # the serving dtype: the same bound, plus bf16's own rounding
    assert bf16.dtype == torch.bfloat16
    assert torch.all((bf16.float() - exact).norm(dim=1) / exact.norm(dim=1) < bound + 0.01)


def test_one_grid_for_the_whole_batch_is_what_it_replaces() -> None:
    """FBGEMM's own per-tensor grid: the quiet row's error is the reason for the anchor."""
    weight = _weight(96, 64)
    module = W8A8Linear(weight, reduce_range=False)
    x = _rows(64)
    shared = torch.ops.quantized.linear_dynamic(x, module.packed, False)
    exact = x @ weight.T
    quiet_error = float((shared[0] - exact[0]).norm() / exact[0].norm())
    assert quiet_error > 0.5  # the 0.01 row beside the 100 row: mostly rounded away


def test_a_group_gives_each_member_exactly_its_own_product() -> None:
    weights = [_weight(96, 64), _weight(32, 64) * 3, _weight(48, 64) / 5]
    group = W8A8Group(weights, reduce_range=False)
    members = [GroupMember(group, i) for i in range(3)]
    alone = [W8A8Linear(w, reduce_range=False) for w in weights]
    x = _rows(64)
    parts = [m(x) for m in members]
    assert group._input is None  # every member took its part: nothing held until the next step
    for part, single in zip(parts, alone, strict=True):
        assert torch.equal(part, single(x))
    y = x * 2  # a new input is a new product, whichever member asks first
    assert torch.equal(members[2](y), alone[2](y)) and torch.equal(members[0](y), alone[0](y))
    assert torch.equal(members[0](y), alone[0](y))  # asked twice: computed again, not a stale part
    x2 = x.clone()
    members[0](x2)
    x2.mul_(3)  # changed in place after the group computed its parts
    assert torch.equal(members[1](x2), alone[1](x2))


def test_a_layer_is_four_products() -> None:
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    modules = grouped_modules({n: _weight(64, 64) for n in names})
    groups = {id(m.group) for m in modules.values() if isinstance(m, GroupMember)}
    assert len(groups) == 2 and isinstance(modules["o_proj"], (W8A8Linear, VnniLinear))
    assert modules["q_proj"].group is modules["v_proj"].group is not modules["up_proj"].group


def _near_greedy(seq_id: int, text: str, seed: int) -> SequenceRequest:
    params = SynthesisParams(seed=seed, temperature=1e-12)
    return SequenceRequest(seq_id=seq_id, text=text, params=params, max_tokens=40)


def _codes(engine: Any, requests: list[SequenceRequest]) -> dict[int, torch.Tensor]:
    seen: dict[int, list[torch.Tensor]] = {}
    engine.token_tap = lambda sid, codes, _h: seen.setdefault(sid, []).append(codes)
    try:
        for r in requests:
            engine.add(r)
        step_until_finished(engine, [r.seq_id for r in requests])
    finally:
        engine.token_tap = None
    return {sid: torch.cat(parts) for sid, parts in seen.items()}


def test_a_streams_tokens_do_not_depend_on_the_batch(tiny_model_dir: Path) -> None:
    from server.engine.chattts.engine import ChatTTSEngine

    engine = ChatTTSEngine.load(
        model_dir=tiny_model_dir,
        device=TEST_DEVICE,
        dtype="float32",
        options=EngineOptions(max_batch=4, quantize="w8a8"),
    )
    try:
        assert engine.info.extra["projections"] == "w8a8"
        kernel = VnniLinear if w8a8_vnni.available() else W8A8Linear
        assert isinstance(engine._llama.layers[0].mlp.down_proj, kernel)
        assert isinstance(engine._llama.layers[0].self_attn.k_proj, GroupMember)
        alone = _codes(engine, [_near_greedy(0, "A sentence spoken alone first.", 7)])[0]
        others = [_near_greedy(i, f"Another, much louder speaker number {i}!", 50 + i) for i in (2, 3, 4)]
        together = _codes(engine, [_near_greedy(1, "A sentence spoken alone first.", 7), *others])
        assert len(alone) > 8
        assert torch.equal(together[1], alone)
    finally:
        engine.close()


def test_w8a8_is_refused_where_it_cannot_run() -> None:
    llama = torch.nn.Module()
    llama.layers = torch.nn.ModuleList()
    with pytest.raises(ValueError, match="x86-64 CPU only"):
        linear.prepare_projections(llama, dtype=torch.float32, device=torch.device("cuda"), quantize="w8a8")
    EngineOptions(quantize="w8a8", compile_step=True)  # compiles since the products became an operator


def test_the_compiled_product_is_the_eager_one_and_still_per_row() -> None:
    module = W8A8Linear(_weight(96, 64), reduce_range=False)
    compiled = torch.compile(module, dynamic=True, fullgraph=True)  # fullgraph: a graph break raises
    x = _rows(64)
    with torch.no_grad():
        eager, together = module(x), compiled(x)
        alone = [compiled(x[i : i + 1]) for i in range(len(x))]  # batch 1 is a graph of its own
        pair = compiled(x[[2, 0]])
    # Fused, the division by the magnitude may round a value across an int8 level: one level of
    # a row's 8-bit grid is 1/127 of its largest input, about 1 % of its output.
    error = (together - eager).norm(dim=1) / eager.norm(dim=1)
    assert torch.all(error < 0.01), error
    for i, row in enumerate(alone):
        assert torch.equal(row, together[i : i + 1]), f"row {i} depends on its batch when compiled"
    assert torch.equal(pair[1], together[0])


def test_a_compiled_group_runs_in_one_graph_and_lets_go_of_its_parts() -> None:
    weights = [_weight(96, 64), _weight(32, 64) * 3, _weight(48, 64) / 5]
    group = W8A8Group(weights, reduce_range=False)
    members = [GroupMember(group, i) for i in range(3)]

    def project(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in members], dim=-1)

    x = _rows(64)
    with torch.inference_mode():  # as the engine steps: the version check must not break the graph
        eager = project(x)
        compiled = torch.compile(project, dynamic=True, fullgraph=True)(x)
    assert group._input is None and all(p is None for p in group._parts)
    assert torch.all((compiled - eager).norm(dim=1) / eager.norm(dim=1) < 0.01)


def test_a_collected_module_leaves_the_operator_s_table() -> None:
    module = W8A8Linear(_weight(96, 64))
    handle = module.handle
    assert w8a8._BY_HANDLE[handle] is module
    del module
    gc.collect()
    assert handle not in w8a8._BY_HANDLE  # the table holds no model's weights alive
