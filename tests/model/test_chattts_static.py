"""The static hot path (KV slots, device sampling, bucketed step, batched decode): tiny model, fp32.

The engine here runs its token step through :class:`tests.model.reference.RecordingRunner`,
which checks on every call what a captured CUDA graph relies on (no host reads, no
replaced tensors, no Python side effects, only shapes prepared in warm-up).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from server.engine.chattts.options import EngineOptions
from server.engine.chattts.setup import kv_slot_bytes
from server.engine_api import EngineError, SequenceRequest, SynthesisParams
from tests.model.helpers import TEST_DEVICE, run_to_end
from tests.model.reference import HostReads, RecordingRunner, plain_generation

TEXTS = [
    "Hello there, this is the first sentence.",
    "And a second one!",
    "第三句话，你好。",
    "A fourth, rather longer sentence that makes a longer prompt than the others do.",
    "五",
    "Six.",
    "Seven seas, seven skies.",
    "八个字的一句话。",
]


def req(seq_id: int, text: str, *, seed: int = 7, max_tokens: int = 48, **kw: Any) -> SequenceRequest:
    return SequenceRequest(
        seq_id=seq_id,
        text=text,
        params=SynthesisParams(seed=seed, **kw),
        max_tokens=max_tokens,
        seed_offset=3,
    )


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Any]:
    from server.engine.chattts.engine import ChatTTSEngine

    options = EngineOptions(max_batch=8)
    eng = ChatTTSEngine.load(
        model_dir=tiny_model_dir,
        device=TEST_DEVICE,
        dtype="float32",
        options=options,
        step_runner=RecordingRunner,
    )
    eng.warmup()
    yield eng
    eng.close()


@pytest.fixture
def taps(engine: Any) -> Iterator[dict[int, list[torch.Tensor]]]:
    seen: dict[int, list[torch.Tensor]] = {}

    def tap(seq_id: int, codes: torch.Tensor, hiddens: torch.Tensor) -> None:
        seen.setdefault(seq_id, []).append(codes)

    engine.token_tap = tap
    yield seen
    engine.token_tap = None


def _codes(taps: dict[int, list[torch.Tensor]], seq_id: int) -> torch.Tensor:
    return torch.cat(taps[seq_id])


def test_slots_are_the_batch_limit_and_memory_is_stated(engine: Any) -> None:
    layout = engine._batch.layout
    expected = 2 * layout.layers * layout.slots * layout.kv_heads * layout.max_len * layout.head_dim * 4
    assert engine.kv_cache_bytes == expected
    assert engine.info.extra["kv_cache_bytes"] == str(expected)
    assert engine.info.extra["kv_slots"] == "8"
    assert engine.info.max_batch == 8 and engine.info.extra["kv_slots_from"] == "--max-batch"
    # The arithmetic that sizes the slots to free memory on CUDA (--max-batch 0) is this layout's.
    assert expected == 8 * kv_slot_bytes(engine._llama.config, layout.max_len, torch.float32)
    assert engine.info.extra["batch_buckets"] == "1,2,4,8"
    assert engine.free_slots == 8


def test_tokens_match_plain_transformers_generation_as_rows_join_and_leave(
    engine: Any, taps: dict[int, list[torch.Tensor]]
) -> None:
    """Rows join at different steps, one pauses, one is dropped, each ends on its own: tokens identical.

    The reference runs each sequence alone through ``LlamaModel.forward`` and a
    ``DynamicCache`` (the path before static slots), with the same draws.
    """
    requests = {i: req(i, TEXTS[i], seed=10 + i, max_tokens=20 + 9 * i) for i in range(5)}
    for i in (0, 1):
        engine.add(requests[i])
    engine.step([0, 1])
    engine.add(requests[2])
    engine.step([0, 1, 2])
    engine.add(requests[3])
    engine.add(requests[4])
    engine.step([1, 2, 3, 4])  # 0 paused
    engine.drop(3)  # leaves mid-stream
    live = [0, 1, 2, 4]
    for _ in range(100):
        if not live:
            break
        for result in engine.step(live):
            if result.finished:
                live.remove(result.seq_id)
    assert not live
    for i in (0, 1, 2, 4):
        codes, _ = plain_generation(engine, requests[i])
        assert torch.equal(_codes(taps, i), codes), f"row {i} diverged from plain generation"
    assert len(taps[3]) > 0
    assert engine.free_slots == engine.slots


def test_row_output_is_independent_of_batch_company(engine: Any, taps: dict[int, list[torch.Tensor]]) -> None:
    """Same seed alone and in a full batch of 8: same tokens, audio within 1e-5 (batched decode included)."""
    alone = run_to_end(engine, [req(100, TEXTS[0], seed=5, max_tokens=70)])[100]
    alone_codes = _codes(taps, 100)
    taps.clear()
    crowd = [req(100, TEXTS[0], seed=5, max_tokens=70)]
    crowd += [req(101 + i, TEXTS[1 + i], seed=20 + i, max_tokens=20 + 11 * i) for i in range(7)]
    together = run_to_end(engine, crowd[::-1])[100]
    assert torch.equal(_codes(taps, 100), alone_codes)
    assert together.tokens == alone.tokens
    assert len(together.samples) == len(alone.samples)
    assert np.abs(together.samples - alone.samples).max() <= 1e-5


def _forced(engine: Any, ids: list[int]) -> None:
    for i in ids:
        engine.add(req(i, TEXTS[i % len(TEXTS)], seed=i, max_tokens=60))


def test_at_most_one_host_read_per_token_whatever_the_batch(tiny_model_dir: Path) -> None:
    """Host reads per step: one per token plus a constant per block, the same at batch 1 and 8."""
    from server.engine.chattts.engine import ChatTTSEngine

    eng = ChatTTSEngine.load(
        model_dir=tiny_model_dir,
        device=TEST_DEVICE,
        dtype="float32",
        # min_tokens: no row ends inside the measured blocks
        options=EngineOptions(max_batch=8, block_schedule=(8, 8, 16), min_tokens=60),
    )
    counts = {}
    try:
        for rows in ([0], list(range(1, 9))):
            _forced(eng, rows)
            eng.step(rows)  # prefill + first block, not measured
            measured = []
            for _ in range(2):  # a block of 8 tokens, then one of 16
                with HostReads() as reads:
                    results = eng.step(rows)
                assert all(r.tokens == (8 if not measured else 16) for r in results)
                measured.append(reads.count)
            counts[len(rows)] = measured
            for i in rows:
                eng.drop(i)
    finally:
        eng.close()
    assert counts[1] == counts[8], counts
    block8, block16 = counts[1]
    assert block16 - block8 <= 8, "more than one host read per token step"
    assert block8 <= 8 + 4, "more than a few host reads per block"


def test_bucket_set_is_closed_after_warmup(engine: Any) -> None:
    """Every serving step runs at a (batch, length) shape warm-up prepared; warm-up prepared them all."""
    runner = engine._batch.runner
    assert runner.prepared == set(engine.step_shapes())
    before = len(runner.runs)
    rng = np.random.default_rng(0)
    seq = 1000
    for size in (1, 3, 8, 2, 5):
        ids = list(range(seq, seq + size))
        for i in ids:
            text = "字" * int(rng.integers(1, 100)) if i % 2 else "word " * int(rng.integers(1, 20))
            engine.add(req(i, text, seed=i, max_tokens=int(rng.integers(5, 80))))
        live = list(ids)
        while live:
            for result in engine.step(live):
                if result.finished:
                    live.remove(result.seq_id)
        seq += size
    served = runner.runs[before:]
    assert {b for b, _ in served} >= {1, 4, 8}
    assert set(served) <= runner.prepared
    assert runner.reads_inside == 0


def test_join_and_leave_never_copy_other_rows_kv(engine: Any) -> None:
    """A paused row's cache keeps its addresses and its bytes while others join, step and leave."""
    kv = engine._batch.kv
    engine.add(req(2000, TEXTS[3], seed=1, max_tokens=200))
    engine.step([2000])
    row = engine._seqs[2000]
    slot, length = row.slot, row.length
    addresses = [t.data_ptr() for t in (*kv.keys, *kv.values)]
    mine = [t[slot, :, :length].clone() for t in (*kv.keys, *kv.values)]
    for i in range(2001, 2008):
        engine.add(req(i, TEXTS[i % 8], seed=i, max_tokens=30))
    others = list(range(2001, 2008))
    engine.step(others)
    engine.drop(2003)
    others.remove(2003)
    while others:
        for result in engine.step(others):
            if result.finished:
                others.remove(result.seq_id)
    assert [t.data_ptr() for t in (*kv.keys, *kv.values)] == addresses
    for before, now in zip(mine, (*kv.keys, *kv.values), strict=True):
        assert torch.equal(before, now[slot, :, :length])
    assert engine._seqs[2000].slot == slot
    engine.drop(2000)
    assert engine.free_slots == engine.slots


def test_segment_max_tokens_caps_sequences_and_sizes_the_slots(tiny_model_dir: Path) -> None:
    from server.engine.chattts.engine import ChatTTSEngine

    # No refinement and no voices from recordings: the longest prompt is a 120-character segment's.
    options = EngineOptions(
        max_batch=2, segment_max_tokens=12, min_tokens=100, refine_max_tokens=0, voice_max_seconds=0.0
    )
    eng = ChatTTSEngine.load(model_dir=tiny_model_dir, device=TEST_DEVICE, dtype="float32", options=options)
    try:
        assert eng.max_len == eng.prefill_length(eng.prompts.prompt_tokens("字" * 120)) + 12
        assert run_to_end(eng, [req(1, "forced", max_tokens=500)])[1].tokens == 12
        with pytest.raises(EngineError, match="too long"):
            eng.add(req(2, "字" * 200))
    finally:
        eng.close()
