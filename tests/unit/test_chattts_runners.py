"""Step runners and decode grouping of the ChatTTS engine (no model weights needed)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("vocos")

from server.engine.chattts.step.graphs import EagerRunner
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
