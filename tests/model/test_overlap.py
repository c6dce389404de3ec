"""Overlapped quanta (``--overlap-quanta``): the same tokens and audio as the synchronous loop.

Two engines of quanta of 4 (float32, tiny model), one reading each quantum before launching
the next, one launching quantum n+1 first. Their step runner and summary reader record what
happens in order, so the tests also see WHEN each quantum is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from server.engine.chattts.options import EngineOptions
from server.engine.chattts.step.graphs import EagerRunner
from server.engine_api import SequenceRequest, SynthesisParams
from tests.model.helpers import TEST_DEVICE

QUANTUM = 4
TEXTS = ["Hello there, this is the first sentence.", "And a second one!", "第三句话，你好。", "Six."]


class RecordingRunner:
    """The eager step, each run logged as ``"step"``."""

    kind = "eager"

    def __init__(self, step: Any, log: list[str]) -> None:
        self._inner = EagerRunner(step)
        self._log = log

    def prepare(self, shapes: Any) -> None:
        self._inner.prepare(shapes)

    def run(self, batch: int, length: int) -> None:
        self._inner.run(batch, length)
        self._log.append("step")


def _record(engine: Any, log: list[str]) -> None:
    """Log the summary reader's ``snapshot`` (queued behind a quantum) and ``wait`` (the host read)."""
    summaries = engine._batch.summaries
    snapshot, wait = summaries.snapshot, summaries.wait

    def snap(*args: Any) -> Any:
        log.append("snap")
        return snapshot(*args)

    def read(*args: Any) -> Any:
        log.append("read")
        return wait(*args)

    summaries.snapshot, summaries.wait = snap, read


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[dict[bool, tuple[Any, list[str]]]]:
    """``{overlap: (engine, its log)}``; no EOS before 40 tokens, so short rows end where told."""
    from server.engine.chattts.engine import ChatTTSEngine

    built: dict[bool, tuple[Any, list[str]]] = {}
    for overlap in (False, True):
        log: list[str] = []
        options = EngineOptions(max_batch=8, quantum_tokens=QUANTUM, overlap_quanta=overlap, min_tokens=40)
        engine = ChatTTSEngine.load(
            model_dir=tiny_model_dir,
            device=TEST_DEVICE,
            dtype="float32",
            options=options,
            step_runner=lambda step, log=log: RecordingRunner(step, log),
        )
        engine.warmup()
        _record(engine, log)
        assert engine.info.extra["overlap_quanta"] == ("on" if overlap else "off")
        built[overlap] = (engine, log)
    yield built
    for engine, _ in built.values():
        engine.close()


def req(seq_id: int, *, max_tokens: int, text: str = TEXTS[0]) -> SequenceRequest:
    return SequenceRequest(
        seq_id=seq_id, text=text, params=SynthesisParams(seed=seq_id), max_tokens=max_tokens, seed_offset=1
    )


@dataclass
class Run:
    """What a scripted run gave: every step's results, and each sequence's codes."""

    steps: list[list[tuple[int, int, bool, bytes]]] = field(default_factory=list)
    codes: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def tokens(self, seq_id: int) -> torch.Tensor:
        return torch.cat(self.codes[seq_id])

    def audio(self, seq_id: int) -> np.ndarray:
        parts = [np.frombuffer(a, np.float32) for step in self.steps for s, _, _, a in step if s == seq_id]
        return np.concatenate(parts)


def _script(engine: Any, *, cancel_at: int | None = None) -> Run:
    """A (200 tokens, EOS after 40) and B (30 tokens: it ends inside a quantum, mid-block) start;
    C joins at step 2; A leaves after step 5 (its stream closed: dropped between steps); B is
    cancelled at ``cancel_at`` (the core's interrupt says a command waits; dropped after that
    step); D comes alone at the end (13 tokens: its block's last quanta run with nothing alive).
    """
    run = Run()

    def tap(seq_id: int, codes: torch.Tensor, hiddens: torch.Tensor) -> None:
        run.codes.setdefault(seq_id, []).append(codes)

    engine.token_tap = tap
    joins = {0: [req(1, max_tokens=200), req(2, max_tokens=30, text=TEXTS[1])], 2: [req(3, max_tokens=90)]}
    live: list[int] = []
    try:
        for step in range(200):
            for request in joins.get(step, []):
                engine.add(request)
                live.append(request.seq_id)
            if not live:
                if 4 in run.codes:
                    break
                engine.add(req(4, max_tokens=13, text=TEXTS[3]))
                live.append(4)
            engine.interrupt = (lambda: True) if step == cancel_at else None
            results = engine.step(live)
            run.steps.append([(r.seq_id, r.tokens, r.finished, r.audio.tobytes()) for r in results])
            ended = {r.seq_id for r in results if r.finished}
            ended |= {1} if step == 5 else set()
            ended |= {2} if step == cancel_at else set()
            for seq_id in ended & set(live):
                engine.drop(seq_id)
                live.remove(seq_id)
        else:
            raise AssertionError("the script did not end")
    finally:
        engine.token_tap = None
        engine.interrupt = None
    return run


def test_overlap_gives_the_synchronous_loops_tokens_and_audio_byte_for_byte(
    engines: dict[bool, tuple[Any, list[str]]],
) -> None:
    """Rows joining and leaving, a row ending mid-block, a lone row ending with quanta still to run."""
    sync, overlap = (_script(engines[mode][0]) for mode in (False, True))
    assert sync.steps == overlap.steps  # every step: the same rows, tokens, ends and audio bytes
    for seq_id in sync.codes:
        assert torch.equal(sync.tokens(seq_id), overlap.tokens(seq_id))
    # the script does what it says: B ended inside a quantum while others stepped; D alone, early
    b_steps = [(t, f) for step in sync.steps for s, t, f, _ in step if s == 2]
    assert sum(t for t, _ in b_steps) == 30 and b_steps[-1][1]
    assert len(sync.tokens(4)) == 13 and len(sync.audio(4)) == 512 * 13 - 256


def test_a_cancel_ends_the_block_after_the_quantum_in_flight_and_leaves_the_others_as_they_were(
    engines: dict[bool, tuple[Any, list[str]]],
) -> None:
    """B cancelled at step 1: the other rows' tokens and audio are those of the synchronous loop;
    under overlap the cut block runs one quantum more (the one launched before the read)."""
    sync, overlap = (_script(engines[mode][0], cancel_at=1) for mode in (False, True))
    for seq_id in (3, 4):  # they ran to their end
        assert torch.equal(sync.tokens(seq_id), overlap.tokens(seq_id))
        assert sync.audio(seq_id).tobytes() == overlap.audio(seq_id).tobytes()
    cut = {mode: next(t for s, t, _, _ in run.steps[1] if s == 2) for mode, run in enumerate((sync, overlap))}
    assert cut[1] == cut[0] + QUANTUM, cut
    for seq_id in (1, 2):  # dropped after a step: the same stream, cut at another token
        short, long = sorted((sync.tokens(seq_id), overlap.tokens(seq_id)), key=len)
        assert torch.equal(long[: len(short)], short)


def _one_block(log: list[str], run: Callable[[], Any]) -> list[str]:
    """What one engine step logged, each quantum's steps as one ``"launch"``."""
    log.clear()
    run()
    return " ".join(log).replace(" ".join(["step"] * QUANTUM), "launch").split()


def test_quantum_n_is_read_after_quantum_n_plus_1_is_launched(
    engines: dict[bool, tuple[Any, list[str]]],
) -> None:
    """The order of launches and reads, synchronous and overlapped; a row that ends runs one quantum
    frozen (its summary unread: one read per quantum that made anything)."""
    orders: dict[bool, list[list[str]]] = {}
    for overlap, (engine, log) in engines.items():
        engine.add(req(9, max_tokens=13))
        step = engine.step
        try:
            first = _one_block(log, lambda step=step: step([9]))  # 8 tokens: 2 quanta
            second = _one_block(log, lambda step=step: step([9]))  # 16 planned; ends at 13
        finally:
            engine.drop(9)
        orders[overlap] = [first, second]
    assert orders[False] == [
        ["launch", "snap", "read", "launch", "snap", "read"],
        ["launch", "snap", "read", "launch", "snap", "read"],  # token 13 in the 2nd quantum: stop
    ]
    assert orders[True] == [
        ["launch", "snap", "launch", "snap", "read", "read"],  # quantum 1 read while 2 runs
        # quantum 2 read (the row ended) while 3 runs frozen; 3 is never read
        ["launch", "snap", "launch", "snap", "read", "launch", "snap", "read"],
    ]
