"""The token step's forms (issue #23): prepacked and int8 projections, and the eager fallback.

* oneDNN-prepacked projections compute the same step as transformers' ``nn.Linear``: in
  float32, near-greedy, with rows joining, pausing, leaving and ending on their own, the
  tokens are identical (bf16, the form serving uses, rounds differently by nature);
* ``--quantize int8`` and ``w8a8`` load, serve a stream, and say so in ``hello`` and ``/metrics``;
* ``--compile-step on`` (inductor, the CPU) gives the same tokens as the eager step in
  float32 with rows joining and leaving, with the default projections and with ``w8a8``, and
  a compile that fails gives way to the eager step; its KV slots are bf16 with a bf16 model,
  which changes no value (the step's keys and values are bf16 when it makes them);
* a runner whose capture raises at warm-up gives way to the eager step: the server starts,
  logs one loud line, says so in ``hello`` and ``/metrics``, and streams.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from server.app import App
from server.config import load_settings
from server.engine.chattts.options import EngineOptions
from server.engine.chattts.step import int8, linear
from server.engine.chattts.step.w8a8 import quantized_engine_available
from server.engine_api import SequenceRequest, SynthesisParams
from tests.model.helpers import TEST_DEVICE, run_to_end, step_until_finished
from tests.model.reference import RecordingRunner
from tests.wsclient import collect, open_client, start

NEAR_GREEDY = 1e-12
TEXTS = ["Hello there, this is the first sentence.", "第二句话，你好。", "Three.", "A fourth, longer one."]


def _request(seq_id: int, *, seed: int, max_tokens: int) -> SequenceRequest:
    params = SynthesisParams(seed=seed, temperature=NEAR_GREEDY)
    return SequenceRequest(seq_id=seq_id, text=TEXTS[seq_id % 4], params=params, max_tokens=max_tokens)


def _join_pause_leave(engine: Any) -> dict[int, torch.Tensor]:
    """Five rows that join at different steps, one paused, one dropped; every row's codes."""
    seen: dict[int, list[torch.Tensor]] = {}
    engine.token_tap = lambda sid, codes, _h: seen.setdefault(sid, []).append(codes)
    try:
        requests = {i: _request(i, seed=30 + i, max_tokens=18 + 7 * i) for i in range(5)}
        engine.add(requests[0])
        engine.add(requests[1])
        engine.step([0, 1])
        engine.add(requests[2])
        engine.step([0, 1, 2])
        engine.add(requests[3])
        engine.add(requests[4])
        engine.step([1, 2, 3, 4])  # row 0 paused
        engine.drop(3)  # leaves mid-stream
        step_until_finished(engine, [0, 1, 2, 4], max_steps=200)
    finally:
        engine.token_tap = None
    return {sid: torch.cat(parts) for sid, parts in seen.items()}


@pytest.fixture(scope="module")
def fp32_engine(tiny_model_dir: Path) -> Iterator[Any]:
    from server.engine.chattts.engine import ChatTTSEngine

    engine = ChatTTSEngine.load(
        model_dir=tiny_model_dir,
        device=TEST_DEVICE,
        dtype="float32",
        options=EngineOptions(max_batch=8),
        step_runner=RecordingRunner,
    )
    yield engine
    engine.close()


@pytest.mark.skipif(
    TEST_DEVICE != "cpu" or not linear.onednn_packing_available(), reason="oneDNN packing is the CPU's"
)
def test_prepacked_projections_give_the_same_tokens_as_nn_linear(fp32_engine: Any) -> None:
    layers = list(fp32_engine._llama.layers)
    assert isinstance(layers[0].self_attn.q_proj, torch.nn.Linear)
    plain = _join_pause_leave(fp32_engine)
    dense = [[getattr(getattr(ly, o), n) for o, n in linear.PROJECTIONS] for ly in layers]
    linear._replace(layers, linear.PackedLinear)
    try:
        assert isinstance(layers[0].mlp.down_proj, linear.PackedLinear)
        packed = _join_pause_leave(fp32_engine)  # prefill (transformers' layers) and steps on them
    finally:
        for layer, modules in zip(layers, dense, strict=True):
            for (owner, name), module in zip(linear.PROJECTIONS, modules, strict=True):
                setattr(getattr(layer, owner), name, module)
    assert set(packed) == set(plain) == {0, 1, 2, 3, 4}
    for sid in plain:
        assert torch.equal(packed[sid], plain[sid]), f"row {sid} diverged"
    assert len(plain[4]) > 16  # rows ran long enough to matter


def test_bf16_on_the_cpu_packs_the_projections_once(tiny_model_dir: Path) -> None:
    from server.engine.chattts.engine import ChatTTSEngine

    engine = ChatTTSEngine.load(model_dir=tiny_model_dir, device=TEST_DEVICE, dtype="bfloat16")
    try:
        expected = "onednn-bf16" if TEST_DEVICE == "cpu" and linear.onednn_packing_available() else "dense"
        assert engine.info.extra["projections"] == expected
        q_proj = engine._llama.layers[0].self_attn.q_proj
        assert isinstance(q_proj, linear.PackedLinear if expected == "onednn-bf16" else torch.nn.Linear)
        got = run_to_end(engine, [_request(1, seed=3, max_tokens=20)])[1]
        assert got.tokens > 0 and len(got.samples) > 0
    finally:
        engine.close()


def test_int8_weights_are_close_to_the_float_weights() -> None:
    torch.manual_seed(0)
    weight = torch.randn(48, 32) * torch.linspace(0.01, 3.0, 48).unsqueeze(1)  # channels of any scale
    q, scale = int8.quantize_int8(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    error = (q.float() * scale.unsqueeze(1) - weight).abs().amax(dim=1)
    assert torch.all(error <= scale / 2 + 1e-6)  # rounding, per channel
    module = linear.Int8Linear(weight)
    dequantized = q.float() * scale.unsqueeze(1)
    for shape in ((5, 3, 32), (2, 20, 32)):  # the int8 kernel's few rows, and a prefill's many
        x = torch.randn(shape)
        assert module(x).shape == (*shape[:-1], 48)
        assert torch.allclose(module(x), x @ dequantized.T, atol=1e-4)


W8A8_HERE = TEST_DEVICE == "cpu" and quantized_engine_available()
#: The token step a server runs with default flags on the test device (CUDA captures graphs).
DEFAULT_STEP = "cuda-graphs" if torch.device(TEST_DEVICE).type == "cuda" else "eager"


@pytest.mark.loopback
@pytest.mark.parametrize(
    "quantize",
    ["int8", pytest.param("w8a8", marks=pytest.mark.skipif(not W8A8_HERE, reason="FBGEMM, x86-64 CPU"))],
)
async def test_a_quantized_server_streams_and_says_so(make_model_app: Any, quantize: str) -> None:
    app: App = await make_model_app("--quantize", quantize)
    ws, hello = await open_client(app.port)
    assert hello["compute"]["quantize"] == quantize and hello["compute"]["dtype"] == "float32"
    assert hello["compute"]["token_step"] == DEFAULT_STEP and "token_step_fallback" not in hello["compute"]
    metrics = app.metrics.render().decode()
    assert f'quantize="{quantize}"' in metrics and f'projections="{quantize}"' in metrics
    await start(ws, id="q", text="Quantized speech, one sentence.", seed=5)
    log = (await collect(ws, {"q"}))["q"]
    await ws.close()
    assert log.done is not None and log.done["reason"] == "complete" and log.done["samples"] > 0


class CaptureFails(RecordingRunner):
    """A capturing runner whose capture raises, as a CUDA graph capture can on an untested GPU."""

    kind = "cuda-graphs"

    def prepare(self, shapes: Any) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")


@pytest.mark.loopback
async def test_a_failed_capture_falls_back_to_the_eager_step(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from server.engine.chattts.engine import ChatTTSEngine

    flags = ["--engine", "chattts", "--model-dir", str(tiny_model_dir), "--device", TEST_DEVICE]
    flags += ["--dtype", "float32", "--host", "127.0.0.1", "--port", "0", "--cache-bytes", "0"]
    settings = load_settings(flags, env={})

    def factory() -> Any:
        return ChatTTSEngine.load(
            model_dir=tiny_model_dir, device=TEST_DEVICE, dtype="float32", step_runner=CaptureFails
        )

    app = App(settings, engine_factory=factory)
    with caplog.at_level(logging.ERROR, logger="server.engine.chattts.step.runner"):
        await app.start()
    try:
        await app.warmed_up.wait()
        loud = [r for r in caplog.records if "TOKEN STEP FALLBACK" in r.getMessage()]
        assert len(loud) == 1 and "cuda-graphs failed at warm-up" in loud[0].getMessage()
        ws, hello = await open_client(app.port)
        assert hello["compute"]["token_step"] == "eager"
        assert "operation not permitted" in hello["compute"]["token_step_fallback"]
        metrics = app.metrics.render().decode()
        assert 'token_step="eager"' in metrics and "token_step_fallback=" in metrics
        await start(ws, id="f", text="Eager after all.", seed=2)
        log = (await collect(ws, {"f"}))["f"]
        await ws.close()
        assert log.done is not None and log.done["reason"] == "complete" and log.done["samples"] > 0
    finally:
        await app.stop()


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the compiled step is the CPU's")
@pytest.mark.timeout(900)  # inductor compiles four graphs: about 2 minutes on a quiet 2-core machine
@pytest.mark.parametrize(
    "quantize",
    [
        "none",
        pytest.param("w8a8", marks=pytest.mark.skipif(not W8A8_HERE, reason="FBGEMM, x86-64 CPU")),
        pytest.param("w8a8-ahead", marks=pytest.mark.skipif(not W8A8_HERE, reason="FBGEMM, x86-64 CPU")),
    ],
)
def test_the_compiled_step_gives_the_same_tokens_as_the_eager_step(
    fp32_engine: Any, tiny_model_dir: Path, quantize: str
) -> None:
    """For w8a8 the compiled step reaches FBGEMM through ``chattts_stream::w8a8_rows``.

    ``w8a8-ahead``: ``--compile-step ahead``, the graphs built ahead of time (``step/aot.py``).
    """
    from server.engine.chattts.engine import ChatTTSEngine
    from server.engine.chattts.step.compiled import CompiledRunner

    quantize, _, ahead = quantize.partition("-")

    def load(compile_step: bool) -> Any:
        options = EngineOptions(
            max_batch=8, quantize=quantize, compile_step=compile_step, compile_ahead=bool(ahead)
        )
        return ChatTTSEngine.load(
            model_dir=tiny_model_dir, device=TEST_DEVICE, dtype="float32", options=options
        )

    if quantize == "none":
        eager = _join_pause_leave(fp32_engine)
    else:
        eager_engine = load(compile_step=False)
        try:
            eager = _join_pause_leave(eager_engine)
        finally:
            eager_engine.close()
    engine = load(compile_step=True)
    try:
        runner = engine._batch.runner
        assert isinstance(runner, CompiledRunner), engine.info.extra.get("token_step_fallback")
        assert runner.ahead_of_time == bool(ahead)
        assert engine.info.extra["token_step"] == "compiled"
        # batches of rows attend through the C++ operator that reads each row only as far as it reaches
        assert engine.info.extra["attention"] == "step_attention"
        assert engine.info.extra["projections"] == ("w8a8" if quantize == "w8a8" else "dense")
        assert "token_step_fallback" not in engine.info.extra
        compiled = _join_pause_leave(engine)  # batch 1 to 4, lengths growing, rows joining and leaving
        assert runner.misses == 0  # every step ran compiled: warm-up met every graph serving needs
    finally:
        engine.close()
    assert set(compiled) == set(eager) == {0, 1, 2, 3, 4}
    for sid in eager:
        assert torch.equal(compiled[sid], eager[sid]), f"row {sid} diverged"


def _bf16_engine(model_dir: Path, **chosen: Any) -> Any:
    """A bf16 engine on the CPU, built without warm-up (a compiled step would compile at warm-up)."""
    from server.engine.chattts.assets import load_chat
    from server.engine.chattts.engine import ChatTTSEngine

    cpu = torch.device("cpu")
    loaded = load_chat(model_dir=model_dir, device=cpu)
    options = EngineOptions(max_batch=8, **chosen)
    return ChatTTSEngine(loaded, device=cpu, dtype=torch.bfloat16, options=options)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU's slot dtype")
def test_the_compiled_cpu_step_keeps_its_slots_in_the_model_dtype(tiny_model_dir: Path) -> None:
    """Compiled, bf16 slots: half the memory and half the bytes each step reads; eager, float32.

    And one spare position: no compiled step attends over a whole slot, whose view dynamo would
    trace as graphs of their own (``step/compiled.py``).
    """
    from server.engine.chattts.step.runner import SPARE_POSITIONS

    eager, compiled = _bf16_engine(tiny_model_dir), _bf16_engine(tiny_model_dir, compile_step=True)
    try:
        assert eager._batch.kv.keys[0].dtype == torch.float32
        assert compiled._batch.kv.keys[0].dtype == torch.bfloat16
        assert compiled._batch.kv.values[0].dtype == torch.bfloat16
        positions, eager_positions = compiled._batch.kv.keys[0].shape[2], eager._batch.kv.keys[0].shape[2]
        assert SPARE_POSITIONS == 1 and positions == eager_positions + 1 == compiled.max_len + 1
        assert max(compiled._batch.length_buckets) == compiled.max_len < positions
        assert max(eager._batch.length_buckets) == eager_positions  # the eager step: no spare needed
        assert 2 * compiled.kv_cache_bytes * eager_positions == eager.kv_cache_bytes * positions
        assert compiled.info.extra["kv_cache_bytes"] == str(compiled.kv_cache_bytes)
    finally:
        eager.close()
        compiled.close()


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU's compiled step")
def test_the_compiled_step_attends_densely_where_its_cpp_attention_does_not_build(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator is an optimisation: a machine that cannot build it still serves, and says so."""
    from server.engine.chattts.step import decode_attention

    eager, built = _bf16_engine(tiny_model_dir), _bf16_engine(tiny_model_dir, compile_step=True)
    monkeypatch.setattr(decode_attention, "load", lambda: False)
    unbuilt = _bf16_engine(tiny_model_dir, compile_step=True)
    try:
        assert eager.info.extra["attention"] == "math_attention"
        assert built.info.extra["attention"] == "step_attention"
        assert unbuilt.info.extra["attention"] == "math_attention"
        assert unbuilt._batch.token_step.attend is not decode_attention.step_attention
    finally:
        for engine in (eager, built, unbuilt):
            engine.close()


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU's slot dtype")
def test_bf16_slots_hold_the_bf16_step_exactly(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's keys and values are bf16 when it makes them: bf16 slots give the same tokens.

    Eagerly (where the attention converts either slot dtype to float32 the same way), with
    rows joining, pausing and leaving: so the compiled step's bf16 slots change no value.
    """
    from server.engine.chattts.step import runner

    def codes(slot_dtype: torch.dtype) -> dict[int, torch.Tensor]:
        monkeypatch.setattr(runner, "kv_dtype", lambda *_a, **_k: slot_dtype)
        engine = _bf16_engine(tiny_model_dir)
        try:
            engine.prepare_step()
            assert engine._batch.kv.keys[0].dtype == slot_dtype
            return _join_pause_leave(engine)
        finally:
            engine.close()

    float_slots, bf16_slots = codes(torch.float32), codes(torch.bfloat16)
    assert set(float_slots) == set(bf16_slots) == {0, 1, 2, 3, 4}
    for sid in float_slots:
        assert torch.equal(float_slots[sid], bf16_slots[sid]), f"row {sid} diverged"


def test_bf16_projections_stay_plain_for_the_compiler() -> None:
    """Inductor packs bf16 weights itself and cannot trace an opaque oneDNN weight."""
    llama = torch.nn.Module()
    llama.layers = torch.nn.ModuleList([_layer(8) for _ in range(2)])
    cpu = torch.device("cpu")
    got = linear.prepare_projections(llama, dtype=torch.bfloat16, device=cpu, quantize="none", compiled=True)
    assert got == "dense" and isinstance(llama.layers[0].self_attn.q_proj, torch.nn.Linear)
    assert llama.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def _layer(width: int) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
    for owner, name in linear.PROJECTIONS:
        setattr(getattr(layer, owner), name, torch.nn.Linear(width, width, bias=False))
    return layer


def _failing_compiler(fn: Any, **options: Any) -> Any:
    """``torch.compile`` on a machine without a C++ compiler: compiling fails, ahead of time or lazily."""

    class Compiled:
        def aot_compile(self, example: Any) -> Any:
            raise RuntimeError("InductorError: CppCompileError: C++ compile error (no g++)")

        def __call__(self, *args: Any) -> None:
            self.aot_compile(args)

    return Compiled()


@pytest.mark.parametrize("ahead", [False, True])  # compiled lazily and frozen, or ahead of time
def test_a_failed_compile_falls_back_to_the_eager_step(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture, ahead: bool
) -> None:
    from server.engine.chattts.engine import ChatTTSEngine
    from server.engine.chattts.step.compiled import CompiledRunner

    def factory(step: Any) -> Any:
        return CompiledRunner(step, compiler=_failing_compiler)

    options = EngineOptions(compile_ahead=ahead)
    with caplog.at_level(logging.ERROR, logger="server.engine.chattts.step.runner"):
        engine = ChatTTSEngine.load(
            model_dir=tiny_model_dir,
            device=TEST_DEVICE,
            dtype="float32",
            step_runner=factory,
            options=options,
        )
    try:
        loud = [r for r in caplog.records if "TOKEN STEP FALLBACK" in r.getMessage()]
        assert len(loud) == 1 and "compiled failed at warm-up" in loud[0].getMessage()
        assert engine.info.extra["token_step"] == "eager"
        assert "no g++" in engine.info.extra["token_step_fallback"]
        got = run_to_end(engine, [_request(1, seed=3, max_tokens=12)])[1]
        assert got.tokens > 0 and len(got.samples) > 0
    finally:
        engine.close()
