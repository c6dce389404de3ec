"""The decode ring (``step/ring.py``): its windows are ``StreamDecoder``'s plan, its audio the same bytes.

Rows of one simulated engine produce states a block at a time (each row on its own block
schedule, joining late, ending early); each row's host-side ``StreamDecoder`` (states pushed,
windows planned and concatenated on the host, the vocoder padding them row by row) runs
beside the ring's path (the same decoder only counting tokens, the states written into the
ring in one indexed copy, the due windows gathered in one). Same windows, same float32 bytes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from server.engine.chattts.decode import StreamDecoder
from server.engine.chattts.step.ring import DecodeRing, Span, ring_tokens

SCHEDULE = (8, 16, 20, 20, 24, 24, 28, 32)
CONTEXT, HOLDBACK = 16, 4


def _decoders(context: int, holdback: int) -> tuple[StreamDecoder, StreamDecoder]:
    make = lambda: StreamDecoder(None, context_tokens=context, holdback_tokens=holdback)  # noqa: E731
    return make(), make()


@pytest.mark.parametrize(
    ("context", "holdback"), [(CONTEXT, HOLDBACK), (2, 12)], ids=["default", "long-holdback"]
)
def test_the_rings_windows_are_the_stream_decoders_plan_and_decode_to_the_same_bytes(
    tiny_engine: Any, context: int, holdback: int
) -> None:
    vocoder, hidden = tiny_engine._batch.vocoder, tiny_engine.hidden_size
    slots, block = 4, max(SCHEDULE)
    capacity = ring_tokens(context_tokens=context, holdback_tokens=holdback, block_schedule=SCHEDULE)
    ring = DecodeRing(slots, capacity, hidden, torch.device("cpu"))
    gen = torch.Generator().manual_seed(7)
    lengths = {0: 180, 1: 37, 2: 95, 3: 150}  # tokens each row makes before it ends
    joins = {0: 0, 1: 0, 2: 3, 3: 5}  # the block each row joins at
    rows: dict[int, dict[str, Any]] = {}
    compared = batched = 0
    for step in range(200):
        for slot, at in joins.items():
            if at == step:
                host, counting = _decoders(context, holdback)
                rows[slot] = {"host": host, "ring": counting, "made": 0, "undecoded": 0, "decodes": 0}
                ring.reset(slot)
        if not rows:
            break
        pending = torch.zeros((slots, block, hidden))
        made: list[tuple[int, int]] = []
        tokens_now = 1 + step % 7  # blocks cut short (as by a waiting command) and whole ones
        for slot, row in rows.items():
            target = SCHEDULE[min(row["decodes"], len(SCHEDULE) - 1)]
            k = min(tokens_now, target - row["undecoded"], lengths[slot] - row["made"])
            states = torch.randn((k, hidden), generator=gen)
            pending[slot, :k] = states
            row["host"].push(states.clone())
            row["ring"].advance(k)
            row["made"] += k
            row["undecoded"] += k
            made.append((slot, k))
        ring.write(pending, made)
        due = []
        for slot, row in rows.items():
            final = row["made"] == lengths[slot]
            target = SCHEDULE[min(row["decodes"], len(SCHEDULE) - 1)]
            if final or row["undecoded"] >= target:
                row["decodes"] += 1
                row["undecoded"] = 0
                window, span = row["host"].plan(final=final), row["ring"].span(final=final)
                assert (window is None) == (span is None)
                if window is not None and span is not None:
                    assert (span.start_token, span.tokens, span.end) == (
                        window.start_token,
                        len(window.hiddens),
                        window.end,
                    )
                    due.append((slot, window, span))
        if due:
            spans = [Span(slot, span.start_token, span.tokens) for slot, _, span in due]
            tokens = vocoder.padded_tokens([s.tokens for s in spans])
            gathered = ring.gather(spans, tokens)
            for row_index, (_, window, span) in enumerate(due):
                assert torch.equal(gathered[row_index, : span.tokens], window.hiddens)
                assert not gathered[row_index, span.tokens :].any()  # padding: zeros
            with torch.inference_mode():
                from_host = vocoder.decode([window.hiddens for _, window, _ in due])
                from_ring = vocoder.decode_gathered(
                    [s.tokens for s in spans],
                    lambda ids, n, spans=spans: ring.gather([spans[i] for i in ids], n),
                )
            for (slot, window, span), a, b in zip(due, from_host, from_ring, strict=True):
                assert a.tobytes() == b.tobytes()
                out_host = rows[slot]["host"].finish(window, a)
                out_ring = rows[slot]["ring"].finish(span, b)
                assert out_host.tobytes() == out_ring.tobytes()
                compared += 1
            batched += len(due) > 1
        for slot in [s for s, row in rows.items() if row["made"] == lengths[s]]:
            del rows[slot]
            ring.reset(slot)
    assert not rows
    assert compared >= 20 and batched >= 3  # many windows, several of them decoded together


def test_the_ring_refuses_a_window_it_no_longer_holds() -> None:
    ring = DecodeRing(2, 8, 4, torch.device("cpu"))
    pending = torch.arange(2 * 12 * 4, dtype=torch.float32).view(2, 12, 4)
    ring.write(pending, [(1, 12)])
    assert torch.equal(ring.gather([Span(1, 4, 8)], 8)[0], pending[1, 4:12])  # the newest 8, wrapped
    with pytest.raises(ValueError, match="not in slot 1's ring"):
        ring.gather([Span(1, 3, 9)], 12)  # token 3 was overwritten by token 11
    with pytest.raises(ValueError, match="not in slot 1's ring"):
        ring.gather([Span(1, 6, 8)], 8)  # token 13 does not exist yet


def test_the_ring_holds_the_longest_window_a_row_asks_for() -> None:
    assert ring_tokens(context_tokens=16, holdback_tokens=4, block_schedule=SCHEDULE) == 56
    # a hold-back longer than the first blocks: the early windows start at token 0
    assert ring_tokens(context_tokens=0, holdback_tokens=30, block_schedule=(8,)) == 40
    assert ring_tokens(context_tokens=16, holdback_tokens=4, block_schedule=(4,)) == 32  # 25, rounded up
