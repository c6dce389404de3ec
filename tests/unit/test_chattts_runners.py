"""Step runners and decode grouping of the ChatTTS engine (no model weights needed)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("vocos")

from server.engine.chattts.step.compiled import HINT_LENGTH, compile_order
from server.engine.chattts.step.graphs import EagerRunner
from server.engine.chattts.step.kv import batch_buckets, length_buckets
from server.engine.chattts.vocode import decode_groups


def test_eager_warmup_runs_each_batch_size_at_its_shortest_and_longest_length() -> None:
    calls: list[tuple[int, int]] = []
    runner = EagerRunner(lambda b, n: calls.append((b, n)))
    runner.prepare([(b, n) for b in (1, 2, 4) for n in (16, 32, 64, 128)])
    assert calls == [(1, 16), (1, 128), (2, 16), (2, 128), (4, 16), (4, 128)]
    runner.run(2, 64)
    assert calls[-1] == (2, 64)
    assert runner.kind == "eager"


def test_decode_groups_one_call_or_runs_of_similar_length() -> None:
    lengths = [52, 8, 48, 12, 40, 52]
    assert decode_groups(lengths, None) == [[0, 5, 2, 4, 3, 1]]
    assert decode_groups(lengths, 0.25) == [[0, 5, 2, 4], [3], [1]]  # 8 < 0.75 · 12
    assert decode_groups(lengths, 0.0) == [[0, 5], [2], [4], [3], [1]]
    assert decode_groups([], 0.25) == []


def test_the_compiled_warmup_compiles_two_graphs_first_at_a_typical_length_then_meets_the_extremes() -> None:
    """Batch 1's graph and the larger batches' graph are compiled by their first calls, at the bucket
    holding :data:`HINT_LENGTH` (inductor's size hints); every batch then meets its shortest and
    longest length, which compile nothing (a guard that did would be met here, not while serving)."""
    lengths = length_buckets(3120, 64)
    order = compile_order([(b, n) for b in batch_buckets(8) for n in lengths])
    assert HINT_LENGTH in lengths
    assert order[0] == (1, HINT_LENGTH) and order[3] == (2, HINT_LENGTH)
    assert order == [
        (1, 256), (1, 16), (1, 3120),
        (2, 256), (2, 16), (2, 3120),
        (4, 16), (4, 3120),
        (8, 16), (8, 3120),
    ]  # fmt: skip
