"""KV memory follows the live rows (issue #23): what the engine reports, checked against the kernel.

On the CPU the KV slots are address space whose pages become resident when written and go
back when a slot is freed (``server/engine/chattts/step/pages.py``); on CUDA they are reserved
whole. The kernel's own count is the ``Rss`` of the slots' mapping in ``/proc/self/smaps``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server.engine.chattts.options import EngineOptions
from server.engine.chattts.step.pages import PAGE
from server.engine_api import SequenceRequest, SynthesisParams
from tests.model.helpers import TEST_DEVICE


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Any]:
    from server.engine.chattts.engine import ChatTTSEngine

    # EOS banned for longer than any row here: every row runs exactly to its max_tokens.
    options = EngineOptions(max_batch=4, min_tokens=10_000)
    eng = ChatTTSEngine.load(model_dir=tiny_model_dir, device=TEST_DEVICE, dtype="float32", options=options)
    eng.warmup()
    yield eng
    eng.close()


def _mapping_rss(address: int) -> tuple[int, int]:
    """Size and resident bytes of the mapping holding ``address`` (``/proc/self/smaps``)."""
    span: tuple[int, int] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if not first.endswith(":"):  # a mapping's header: "start-end perms offset dev inode path"
                low, high = (int(x, 16) for x in first.split("-"))
                span = (low, high) if low <= address < high else None
            elif span is not None and first == "Rss:":
                return span[1] - span[0], int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def _lazy_kv(engine: Any) -> Any:
    kv = engine._batch.kv
    if not kv.lazy:
        pytest.skip("on this device the KV slots are reserved whole (checked below)")
    return kv


def _kernel_rss(kv: Any) -> int:
    size, rss = _mapping_rss(kv.keys[0].data_ptr())
    assert size == -(-kv.nbytes // PAGE) * PAGE, "the KV slots should be one mapping of their own"
    return rss


def _slack(engine: Any) -> int:
    """One page per head, layer, K/V and slot (page rounding; pages a freed slot's edges keep)."""
    layout = engine._batch.layout
    return 2 * 2 * layout.layers * layout.kv_heads * layout.slots * PAGE


def _position_bytes(engine: Any) -> int:
    layout = engine._batch.layout
    return 2 * layout.layers * layout.kv_heads * layout.head_dim * 4


def _request(seq_id: int, text: str, max_tokens: int) -> SequenceRequest:
    params = SynthesisParams(seed=seq_id)
    return SequenceRequest(seq_id=seq_id, text=text, params=params, max_tokens=max_tokens)


def test_a_warm_engine_holds_no_kv_memory_on_the_cpu(engine: Any) -> None:
    """Warm-up stepped every slot (writing each at position 0) and handed all of it back."""
    kv = _lazy_kv(engine)
    assert engine.kv_resident_bytes() == 0 < engine.kv_cache_bytes
    layout = engine._batch.layout
    slot_bytes = layout.kv_heads * layout.max_len * layout.head_dim * 4  # one slot of one layer's K or V
    # A slot's region that does not start and end on page boundaries keeps its two edge pages.
    edges = 0 if slot_bytes % PAGE == 0 else 2 * 2 * layout.layers * layout.slots * PAGE
    assert _kernel_rss(kv) <= edges


def test_kv_memory_scales_with_the_live_rows_lengths_and_is_freed_with_them(engine: Any) -> None:
    kv = _lazy_kv(engine)
    engine.add(_request(1, "Hello there.", 200))
    engine.add(_request(2, "A rather longer sentence for the second row to speak.", 1500))
    live, seen, alone = [1, 2], [], []
    while live:
        results = engine.step(live)
        held = sum(row.length for row in engine._seqs.values())  # positions the live rows hold
        seen.append((held, engine.kv_resident_bytes(), _kernel_rss(kv)))
        if list(engine._seqs) == [2]:  # the short row has ended, its slot is free, the long one steps on
            alone.append((engine._seqs[2].length, seen[-1][1]))
        live = [r.seq_id for r in results if not r.finished]
    assert engine.live_sequences == 0
    slack = _slack(engine)
    for held, reported, kernel in seen[:-1]:
        assert abs(reported - held * _position_bytes(engine)) <= slack, (held, reported)
        assert abs(kernel - reported) <= slack, (held, reported, kernel)
    largest = max(seen)
    assert largest[0] > 1500 and largest[2] > 1500 * _position_bytes(engine)  # it grew with the rows
    # The short row ended first: the memory went down with it while the long one went on.
    assert any(later[0] < earlier[0] for earlier, later in itertools.pairwise(seen))
    # The freed slot is still inside the step's batch: it writes at position 0, one page per head.
    layout = engine._batch.layout
    runs, run_bytes = 2 * layout.layers * layout.kv_heads, layout.head_dim * 4
    assert alone
    for length, reported in alone:
        long_row = runs * (-(-(length + 1) * run_bytes // PAGE) * PAGE)
        assert long_row <= reported <= long_row + runs * PAGE, (length, reported)
    # Every row ended and its pages went back; what is left is the first page of each head of a
    # freed slot that the last block still stepped over (a freed row writes at position 0).
    assert seen[-1][0] == 0 and seen[-1][1] <= slack and seen[-1][2] <= slack


def test_device_kv_memory_is_reserved_whole(engine: Any) -> None:
    if engine._batch.kv.lazy:
        pytest.skip("the CPU's slots are lazily resident (checked above)")
    assert engine.kv_resident_bytes() == engine.kv_cache_bytes
