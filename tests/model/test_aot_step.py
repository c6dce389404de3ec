"""The compiled step's graphs built ahead of time (``step/aot.py``, ``step/compiled.py``), on a toy step.

* a graph saved in the cache's folder is loaded by a new runner (a restart) and computes with
  the new runner's step object, its own tensors, not the ones it was built with;
* a saved graph whose Python constants the new step does not share (another W8A8 handle, another
  repetition penalty) is compiled again, not loaded: once saved, nothing else would check them;
* a shape the graphs' guards refuse after warm-up runs eagerly, logged once and counted
  (``misses``), with the eager step's result: never a compile in the middle of serving.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from server.engine.chattts.step.compile_cache import CompileCache
from server.engine.chattts.step.compiled import CompiledRunner
from tests.model.helpers import TEST_DEVICE

pytestmark = [
    pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the compiled step is the CPU's"),
    pytest.mark.timeout(900),  # inductor compiles two small graphs, twice in one test
]

#: The toy's state holds this many positions: a longer length is outside the graphs' guards.
POSITIONS = 32
SHAPES = [(1, 8), (1, 16), (1, 24), (2, 8), (2, 24), (4, 8), (4, 24)]
FACTS = {"torch": torch.__version__, "step": "toy"}


class ToyStep:
    """A static step like the token step: two ints in, state changed in place, nothing returned."""

    def __init__(self, scale: float, offset: float = 0.0) -> None:
        self.offset = (
            offset  # a float: a constant of the graph, as the repetition penalty (and the W8A8 handles) are
        )
        self.weight = torch.full((4, 4), scale)
        self.columns = torch.arange(POSITIONS, dtype=torch.float32)
        self.out = torch.zeros(4, 4)

    def __call__(self, batch: int, length: int) -> None:
        rows = torch.ones(batch, 4) * self.columns[:length].sum() + self.offset
        self.out[:batch] = rows @ self.weight


def _expected(scale: float, batch: int, length: int, offset: float = 0.0) -> torch.Tensor:
    eager = ToyStep(scale, offset)
    eager(batch, length)
    return eager.out


def test_a_saved_graph_is_loaded_and_computes_with_the_new_steps_tensors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = CompileCache(tmp_path / "compiled")
    built, loaded = ToyStep(1.0), ToyStep(3.0)
    first = CompiledRunner(built, ahead_of_time=True)
    first.use_cache(cache, FACTS)
    first.prepare(SHAPES)
    (folder,) = [p for p in cache.root.iterdir() if p.is_dir()]
    assert sorted(p.name for p in (folder / "aot").iterdir()) == [
        "batch1.json",
        "batch1.pt",
        "batches.json",
        "batches.pt",
    ]

    before = built.out.clone()
    restart = CompiledRunner(loaded, compiler=_no_compiler, ahead_of_time=True)  # compiles nothing
    restart.use_cache(cache, FACTS)
    with caplog.at_level(logging.INFO, "server.engine.chattts.step.compiled"):
        restart.prepare(SHAPES)
    assert any(f"2 of 2 graphs' code from {folder}" in r.getMessage() for r in caplog.records)
    for batch, length in [(1, 16), (3, 20)]:
        restart.run(batch, length)
        assert torch.equal(loaded.out[:batch], _expected(3.0, batch, length)[:batch]), (batch, length)
    assert restart.misses == 0 and torch.equal(built.out, before)  # the first step's tensors: untouched


def test_a_saved_graph_of_other_constants_is_compiled_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = CompileCache(tmp_path / "compiled")
    first = CompiledRunner(ToyStep(1.0), ahead_of_time=True)
    first.use_cache(cache, FACTS)
    first.prepare(SHAPES)
    other = ToyStep(1.0, offset=5.0)
    restart = CompiledRunner(other, ahead_of_time=True)
    restart.use_cache(cache, FACTS)
    with caplog.at_level(logging.INFO, "server.engine.chattts.step.compiled"):
        restart.prepare(SHAPES)
    refused = [r.getMessage() for r in caplog.records if "not loaded" in r.getMessage()]
    assert len(refused) == 2 and all("step.offset: 0.0 then, 5.0 now" in m for m in refused), refused
    assert any("0 of 2 graphs' code" in r.getMessage() for r in caplog.records)
    restart.run(2, 16)
    assert restart.misses == 0 and torch.equal(other.out[:2], _expected(1.0, 2, 16, offset=5.0)[:2])


def test_a_shape_the_guards_refuse_steps_eagerly_and_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    step = ToyStep(2.0)
    runner = CompiledRunner(step, ahead_of_time=True)
    runner.prepare(SHAPES)
    assert runner.misses == 0  # warm-up met every graph within its guards
    with caplog.at_level(logging.WARNING, "server.engine.chattts.step.compiled"):
        for _ in range(2):
            runner.run(2, POSITIONS + 8)  # longer than the state: outside the shape guards
    assert runner.misses == 2
    assert sum("stepping eagerly" in r.getMessage() for r in caplog.records) == 1  # logged once
    assert torch.equal(step.out[:2], _expected(2.0, 2, POSITIONS + 8)[:2])
    runner.run(2, 16)
    assert runner.misses == 2 and torch.equal(step.out[:2], _expected(2.0, 2, 16)[:2])


def _no_compiler(fn: object, **options: object) -> object:
    raise AssertionError("a runner whose graphs are in the cache compiled one")
