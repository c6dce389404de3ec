"""Batched prefill (issue 43, item 4): a step's newcomers prefill together, and nobody can tell.

* in float32 on the CPU a batched prefill writes the same KV and hidden states, bit for bit, as
  one row at a time, so a seeded row speaks the same tokens whoever it was prefilled with;
* its embedding equals ChatTTS's ``Embed`` + ``Speaker.apply`` bit for bit and reads nothing
  back to the host (ChatTTS's boolean-mask selection does);
* the prefill step is what a CUDA graph needs (a recording runner checks it on the CPU), its
  shapes are powers of two within a token budget, and float32 on CUDA prefills one row per call
  (not shown bitwise there); warm-up meets every shape a burst prefills at (test_chattts_engine).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from server.engine.chattts.options import EngineOptions
from server.engine.chattts.step.prefill import EagerPrefill, counts_for, rows_per_call, split
from server.engine_api import SequenceRequest, SynthesisParams, VoiceSample
from tests.model.helpers import TEST_DEVICE, run_to_end
from tests.model.opcount import OpCount
from tests.model.reference import RecordingRunner

#: Eight newcomers: two prompt buckets of several rows each, speaker seeds, a speaker-less
#: recording voice, different sampling settings.
TEXTS = [
    "Hello there, this is the first sentence.",
    "And a second one!",
    "第三句话，你好。",
    "Four, and a little longer than the others.",
    "Five.",
    "六个字的句子。",
    "Seven is a lucky number, they say.",
    "Eight!",
]


def _request(seq_id: int, *, reference: VoiceSample | None = None) -> SequenceRequest:
    params = SynthesisParams(
        voice=f"seed:{seq_id % 3 + 1}",
        seed=100 + seq_id,
        temperature=0.3 + 0.1 * (seq_id % 4),
        top_p=0.7 + 0.05 * (seq_id % 3),
        top_k=10 + seq_id,
        reference=reference,
    )
    return SequenceRequest(seq_id=seq_id, text=TEXTS[seq_id % 8], params=params, max_tokens=24)


def _recording() -> VoiceSample:
    codes = np.random.default_rng(0).integers(0, 600, size=(4, 40)).astype(np.int32)
    return VoiceSample(codes=codes, transcript="一段参考录音。")


def _requests() -> list[SequenceRequest]:
    return [_request(i, reference=_recording() if i == 5 else None) for i in range(8)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Any]:
    from server.engine.chattts.engine import ChatTTSEngine

    eng = ChatTTSEngine.load(
        model_dir=tiny_model_dir, device=TEST_DEVICE, dtype="float32", options=EngineOptions(max_batch=16)
    )
    eng.warmup()
    yield eng
    eng.close()


class MaskIndexing(TorchDispatchMode):
    """Indexing by a boolean mask: one ``aten::index`` on the CPU, a ``nonzero`` and a read on a GPU.

    OpCount sees the sync only where the device dispatches it, so on the CPU this names the cause.
    """

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        name, indices = func._schema.name, args[1] if len(args) > 1 else None
        by_mask = isinstance(indices, list) and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices
        )
        if by_mask and name.startswith(("aten::index", "aten::_index_put")):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


class Calls:
    """Wraps a prefill runner and records each call's ``(count, length)``."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.kind, self.runs = inner, inner.kind, []

    def prepare(self, shapes: Any) -> None:
        self.inner.prepare(shapes)

    def run(self, count: int, length: int) -> None:
        self.runs.append((count, length))
        self.inner.run(count, length)


def _snapshot(engine: Any, seq_ids: list[int]) -> dict[int, list[torch.Tensor]]:
    """Each sequence's state after its prefill: hidden state, lengths, settings, every layer's K and V."""
    batch = engine._batch
    st, kv = batch.state, batch.kv
    out = {}
    for seq_id in seq_ids:
        row = engine._seqs[seq_id]
        s, n = row.slot, row.length
        parts = [st.hidden[s], st.lengths[s], st.temperature[s], st.top_p[s], st.top_k[s], st.key0[s]]
        parts += [t[s, :, :n] for t in (*kv.keys, *kv.values)]
        out[seq_id] = [p.detach().clone() for p in parts]
    return out


def _prefill(engine: Any, requests: list[SequenceRequest], together: bool) -> dict[int, list[torch.Tensor]]:
    """Prefill the requests together (one ``prefill`` call) or each alone; snapshot; drop them."""
    ids = [r.seq_id for r in requests]
    for r in requests:
        engine.add(r)
    rows = [engine._seqs[i] for i in ids]
    try:
        with torch.inference_mode():
            if together:
                engine._batch.prefill(rows)
            else:
                for row in rows:
                    engine._batch.prefill([row])
        return _snapshot(engine, ids)
    finally:
        for i in ids:
            engine.drop(i)


def test_batched_float32_prefill_is_bitwise_one_at_a_time(engine: Any) -> None:
    """KV, hidden states and settings of eight newcomers: the same bits together as alone."""
    prefiller = engine._batch.prefiller
    calls = prefiller.runner = Calls(prefiller.runner)
    try:
        alone = _prefill(engine, _requests(), together=False)
        assert all(count == 1 for count, _ in calls.runs)
        calls.runs.clear()
        together = _prefill(engine, _requests(), together=True)
    finally:
        prefiller.runner = calls.inner
    assert max(count for count, _ in calls.runs) >= 2, f"nothing was batched: {calls.runs}"
    assert len({length for _, length in calls.runs}) >= 2, "the test needs two prompt buckets"
    for seq_id, parts in alone.items():
        for i, (a, b) in enumerate(zip(parts, together[seq_id], strict=True)):
            assert torch.equal(a, b), f"sequence {seq_id}, part {i}: max difference {(a - b).abs().max()}"


def test_a_row_speaks_the_same_tokens_whoever_it_is_prefilled_with(engine: Any) -> None:
    """Seeded rows started alone, then all eight in one step (one batched prefill): the same tokens."""
    codes: dict[int, list[torch.Tensor]] = {}
    engine.token_tap = lambda sid, c, _h: codes.setdefault(sid, []).append(c)
    try:
        alone = {}
        for r in _requests():
            alone |= run_to_end(engine, [r])
        alone_codes = {sid: torch.cat(parts) for sid, parts in codes.items()}
        codes.clear()
        together = run_to_end(engine, _requests())
    finally:
        engine.token_tap = None
    for sid, got in together.items():
        assert got.tokens == alone[sid].tokens
        assert torch.equal(torch.cat(codes[sid]), alone_codes[sid]), f"sequence {sid}"
        assert np.abs(got.samples - alone[sid].samples).max() < 1e-4


def test_the_embedding_is_chattts_own_and_reads_nothing_back(engine: Any) -> None:
    """The staged prompts embed to ChatTTS's ``Embed`` + ``Speaker.apply``, bit for bit; no host sync."""
    requests = _requests()
    for r in requests:
        engine.add(r)
    rows = [engine._seqs[r.seq_id] for r in requests]
    prefiller, chat = engine._batch.prefiller, engine._chat
    count, masks = OpCount(), MaskIndexing()
    try:
        with torch.inference_mode():
            for length, members in prefiller.calls(rows):
                with count.counting(), masks:
                    prefiller._stage(members, list(range(len(members))), length)
                    got = prefiller.step.embed(len(members), length)
                for i, row in enumerate(members):
                    want = chat.embed(row.input_ids, row.text_mask)
                    if row.speaker is not None:
                        spk = chat.tokenizer.spk_emb_ids
                        chat.speaker.apply(want, row.speaker, row.input_ids, spk, engine.device)
                    n = int(row.input_ids.shape[1])
                    assert torch.equal(got[i, :n], want[0]), f"sequence {row.request.seq_id}"
    finally:
        for r in requests:
            engine.drop(r.seq_id)
    assert any(row.speaker is None for row in rows) and any(row.speaker is not None for row in rows)
    assert count.syncs == [], f"the prefill's embedding read back to the host: {count.syncs}"
    assert masks.seen == [], f"the prefill's embedding indexes by a boolean mask: {masks.seen}"


def test_the_prefill_step_is_what_a_cuda_graph_needs(engine: Any) -> None:
    """Every call at a prepared shape; no read to the host, no tensor or attribute replaced, inputs kept."""
    prefiller = engine._batch.prefiller
    inner, step = prefiller.runner, prefiller.step
    recording = prefiller.runner = RecordingRunner(step)
    inputs = {name: t.data_ptr() for name, t in step.inputs().items()}
    try:
        with torch.inference_mode():
            prefiller.prepare(engine.longest_prompt)
            assert recording.prepared == set(prefiller.shapes(engine.longest_prompt))
            out = run_to_end(engine, _requests()[:7])  # 7 rows: calls of 4, 2 and 1 in a bucket
    finally:
        prefiller.runner = inner
    assert all(c.tokens > 0 for c in out.values())
    assert sum(count for count, _ in recording.runs) == 7 and max(c for c, _ in recording.runs) > 1
    assert {name: t.data_ptr() for name, t in step.inputs().items()} == inputs


def test_calls_are_powers_of_two_within_the_token_budget() -> None:
    assert counts_for(16, 512, 16) == (1, 2, 4, 8, 16)
    assert counts_for(48, 512, 16) == (1, 2, 4, 8)  # 10 rows fit: the power of two below
    assert counts_for(160, 512, 16) == (1, 2)
    assert counts_for(1072, 512, 16) == (1,)  # longer than the budget: alone
    assert counts_for(16, 512, 4) == (1, 2, 4)  # never more rows than slots
    assert split(7, (1, 2, 4)) == [4, 2, 1]
    assert split(11, (1, 2, 4)) == [4, 4, 2, 1]
    assert split(3, (1,)) == [1, 1, 1]


def test_float32_on_cuda_prefills_one_row_per_call() -> None:
    """cuBLAS picks kernels by the product's size: batched float32 there is not shown bitwise."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert rows_per_call(cuda, torch.float32, 16) == 1
    assert rows_per_call(cuda, torch.bfloat16, 16) == rows_per_call(cuda, torch.float16, 16) == 16
    assert rows_per_call(cpu, torch.float32, 16) == 16  # bitwise here: the first test


def test_a_failed_prefill_gives_its_slots_back(engine: Any) -> None:
    class Failing:
        kind = "eager"

        def prepare(self, shapes: Any) -> None:
            pass

        def run(self, count: int, length: int) -> None:
            raise RuntimeError("boom")

    prefiller = engine._batch.prefiller
    inner, free = prefiller.runner, engine.free_slots
    prefiller.runner = Failing()
    try:
        engine.add(_request(1))
        with pytest.raises(RuntimeError, match="boom"):
            engine.step([1])
        assert engine.free_slots == free and engine._seqs[1].slot == -1
    finally:
        prefiller.runner = inner
        engine.drop(1)


def test_a_failed_capture_gives_way_to_the_eager_prefill(engine: Any, caplog: Any) -> None:
    class Capture:
        kind = "cuda-graphs"

        def prepare(self, shapes: Any) -> None:
            raise RuntimeError("capture failed")

        def run(self, count: int, length: int) -> None:
            raise AssertionError("never prepared")

    prefiller = engine._batch.prefiller
    inner, free = prefiller.runner, engine.free_slots
    prefiller.runner = Capture()
    try:
        with torch.inference_mode():
            prefiller.prepare(engine.longest_prompt)
        assert isinstance(prefiller.runner, EagerPrefill)
        assert "capture failed" in prefiller.describe()["prefill_fallback"]
        assert "PREFILL FALLBACK" in caplog.text and engine.free_slots == free
        assert run_to_end(engine, [_request(2)])[2].tokens > 0
    finally:
        prefiller.runner, prefiller.fallback = inner, None


def test_the_cpu_warms_the_smallest_prefill_shape_only(engine: Any) -> None:
    """On the CPU warm-up prefills one shape, not every one: each cost real compute, no capture.

    97 shapes were 64 s of a 66.5 s engine warm-up with the full-size model; CUDA warms them all.
    """
    prefiller = engine._batch.prefiller
    runner = prefiller.runner
    assert isinstance(runner, EagerPrefill) and not runner.every_shape
    shapes = prefiller.shapes(engine.longest_prompt)
    assert len(shapes) > 1
    calls: list[tuple[int, int]] = []
    step = runner._step
    runner._step = lambda count, length: (calls.append((count, length)), step(count, length))[1]
    try:
        with torch.inference_mode():
            prefiller.prepare(engine.longest_prompt)
    finally:
        runner._step = step
    assert calls == [min(shapes)]
    everything: list[tuple[int, int]] = []
    EagerPrefill(lambda count, length: everything.append((count, length)), every_shape=True).prepare(shapes)
    assert everything == shapes
