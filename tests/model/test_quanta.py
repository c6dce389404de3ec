"""Quanta (``--quantum-tokens``): one host read per quantum, the same tokens and audio as a token at a time.

The op-count test stands in for a GPU profile on the CPU: the eager step is marked as the
captured region (a CUDA graph replay on a GPU) and the decode as its own stage (issue 43's
point 3 captures it); what is left is what the host does around them, per quantum.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from server.engine.chattts.options import EngineOptions
from server.engine_api import SequenceRequest, SynthesisParams
from tests.model.helpers import TEST_DEVICE, Collected, run_to_end
from tests.model.opcount import MarkedRunner, OpCount

QUANTUM = 4
ROWS = (1, 8, 32)
TEXTS = ["Hello there, this is the first sentence.", "And a second one!", "第三句话，你好。", "Six."]


def req(seq_id: int, *, seed: int, max_tokens: int, text: str = TEXTS[0]) -> SequenceRequest:
    return SequenceRequest(
        seq_id=seq_id, text=text, params=SynthesisParams(seed=seed), max_tokens=max_tokens, seed_offset=3
    )


def load(tiny_model_dir: Path, options: EngineOptions, **kw: Any) -> Any:
    from server.engine.chattts.engine import ChatTTSEngine

    engine = ChatTTSEngine.load(
        model_dir=tiny_model_dir, device=TEST_DEVICE, dtype="float32", options=options, **kw
    )
    engine.warmup()
    return engine


@pytest.fixture(scope="module", params=[False, True], ids=["synchronous", "overlapped"])
def counted(tiny_model_dir: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Any, OpCount]]:
    """A K=4 engine of 32 slots whose step and decode are marked regions; no row ends before 60 tokens.

    Synchronous quanta (each read before the next is launched) or overlapped ones (``--overlap-quanta``).
    """
    count = OpCount()
    options = EngineOptions(
        max_batch=max(ROWS),
        block_schedule=(8, 8, 16),
        quantum_tokens=QUANTUM,
        min_tokens=60,
        overlap_quanta=request.param,
    )
    engine = load(tiny_model_dir, options, step_runner=lambda step: MarkedRunner(step, count))
    batch = engine._batch
    batch.block.decode = count.mark(batch.block.decode, "decode")
    yield engine, count
    engine.close()


def test_one_host_sync_per_quantum_and_host_ops_independent_of_the_rows(
    counted: tuple[Any, OpCount],
) -> None:
    """At 1, 8 and 32 rows: exactly one host sync per quantum; the same ops outside the step."""
    engine, count = counted
    assert engine.info.extra["quantum_tokens"] == str(QUANTUM)
    seen: dict[int, list[tuple[int, int, int]]] = {}
    for rows in ROWS:
        ids = list(range(1000 * rows, 1000 * rows + rows))
        for i in ids:
            engine.add(req(i, seed=i, max_tokens=200, text=TEXTS[i % len(TEXTS)]))
        engine.step(ids)  # prefills and the first block (8 tokens): not measured
        seen[rows] = []
        for tokens in (8, 16):  # blocks of 2 and 4 quanta, every row decoding at the end of each
            count.reset()
            with count.counting():
                results = engine.step(ids)
            assert [r.tokens for r in results] == [tokens] * rows
            assert count.steps == tokens
            quanta = tokens // QUANTUM
            assert len(count.syncs) == quanta, f"{rows} rows, {quanta} quanta: host syncs {count.syncs}"
            seen[rows].append((quanta, sum(count.outside.values()), count.region_syncs["decode"]))
        for i in ids:
            engine.drop(i)
    # the host's ops around the step do not grow with the rows (the decode stage does: point 3's)
    outside = {rows: [ops for _, ops, _ in blocks] for rows, blocks in seen.items()}
    assert outside[1] == outside[8] == outside[32], outside
    print("\nquanta, ops outside the step and the decode, syncs inside the decode, per block:", seen)


def test_the_interrupt_is_asked_only_between_quanta(counted: tuple[Any, OpCount]) -> None:
    """A waiting command ends the block at the next quantum boundary, never inside a quantum.

    Overlapped, the next quantum is already launched when a quantum is read: the block ends
    after that one, and a block's last two quanta ask nobody.
    """
    engine, _ = counted
    if engine.info.extra["overlap_quanta"] == "on":
        _interrupt_overlapped(engine)
        return
    engine.add(req(1, seed=1, max_tokens=200))
    asked: list[int] = []

    def never() -> bool:
        asked.append(1)
        return False

    def always() -> bool:
        asked.append(1)
        return True

    try:
        engine.interrupt = never
        assert [r.tokens for r in engine.step([1])] == [8]  # 2 quanta: asked once, between them
        assert len(asked) == 1
        asked.clear()
        engine.interrupt = always
        assert [r.tokens for r in engine.step([1])] == [QUANTUM]  # cut, but after a whole quantum
        assert [r.tokens for r in engine.step([1])] == [QUANTUM]  # the rest of the 8-token block
        assert len(asked) == 1  # the last quantum of a block asks nobody
    finally:
        engine.interrupt = None
        engine.drop(1)


def _interrupt_overlapped(engine: Any) -> None:
    engine.add(req(1, seed=1, max_tokens=200))
    asked: list[int] = []

    def ask(answer: bool) -> Any:
        def interrupt() -> bool:
            asked.append(1)
            return answer

        return interrupt

    try:
        engine.interrupt = ask(True)
        assert [r.tokens for r in engine.step([1])] == [8]  # 2 quanta: the 2nd runs while the 1st is read
        assert [r.tokens for r in engine.step([1])] == [8]
        assert not asked
        engine.interrupt = ask(False)
        assert [r.tokens for r in engine.step([1])] == [16]  # 4 quanta: asked after the 1st and 2nd
        assert len(asked) == 2
        asked.clear()
        engine.interrupt = ask(True)
        assert [r.tokens for r in engine.step([1])] == [2 * QUANTUM]  # cut after the quantum in flight
        assert [r.tokens for r in engine.step([1])] == [2 * QUANTUM]  # the rest of the 16-token block
        assert len(asked) == 1
    finally:
        engine.interrupt = None
        engine.drop(1)


Spoken = tuple[dict[int, Collected], dict[int, torch.Tensor]]


def _speak(engine: Any, requests: list[SequenceRequest]) -> Spoken:
    codes: dict[int, list[torch.Tensor]] = {}

    def tap(seq_id: int, c: torch.Tensor, hiddens: torch.Tensor) -> None:
        codes.setdefault(seq_id, []).append(c)

    engine.token_tap = tap
    try:
        out = run_to_end(engine, requests)
    finally:
        engine.token_tap = None
    return out, {seq: torch.cat(parts) for seq, parts in codes.items()}


@pytest.fixture(scope="module")
def quantum_engine(tiny_model_dir: Path) -> Iterator[Any]:
    """The default options with quanta of 4 (as on CUDA), 32 slots."""
    engine = load(tiny_model_dir, EngineOptions(max_batch=32, quantum_tokens=QUANTUM))
    yield engine
    engine.close()


@pytest.mark.parametrize("cut", [False, True], ids=["whole-blocks", "cut-at-every-quantum"])
def test_a_lone_stream_under_quanta_equals_the_token_at_a_time_loop_byte_for_byte(
    tiny_engine: Any, quantum_engine: Any, cut: bool
) -> None:
    """K=4 (blocks whole, or cut by a waiting command at every quantum) against K=1: same bytes.

    The row ends (EOS at its 29th token) inside a quantum, whose last steps then run with the
    row ended.
    """
    assert tiny_engine.info.extra["quantum_tokens"] == "1"  # the CPU's default: today's loop
    request = req(7, seed=11, max_tokens=73, text=TEXTS[2])
    before, before_codes = _speak(tiny_engine, [request])
    quantum_engine.interrupt = (lambda: True) if cut else None
    try:
        after, after_codes = _speak(quantum_engine, [request])
    finally:
        quantum_engine.interrupt = None
    assert before[7].tokens == after[7].tokens
    assert after[7].tokens % QUANTUM, "the end should fall inside a quantum"
    assert torch.equal(before_codes[7], after_codes[7])
    assert before[7].samples.tobytes() == after[7].samples.tobytes()
    if cut:
        assert after[7].steps > before[7].steps


def test_a_seeded_stream_alone_and_among_31_others_gives_the_same_tokens(quantum_engine: Any) -> None:
    """Under quanta, in float32: a row's tokens do not depend on its company; its audio within 1e-5."""
    lone = req(500, seed=5, max_tokens=90, text=TEXTS[0])
    alone, alone_codes = _speak(quantum_engine, [lone])
    crowd = [req(501 + i, seed=40 + i, max_tokens=10 + 7 * i, text=TEXTS[i % 4]) for i in range(31)]
    together, together_codes = _speak(quantum_engine, [*crowd[:17], lone, *crowd[17:]])
    assert torch.equal(together_codes[500], alone_codes[500])
    assert together[500].tokens == alone[500].tokens
    assert len(together[500].samples) == len(alone[500].samples)
    assert np.abs(together[500].samples - alone[500].samples).max() <= 1e-5
