"""The memory budget's ledger and the outbox's charges to it (issue #25, finding 5), without I/O."""

from __future__ import annotations

import asyncio

from server.audio.base import EncodedFrame
from server.streams.budget import ITEM_OVERHEAD_BYTES, MemoryBudget
from server.streams.outbox import Outbox

FRAME = EncodedFrame(b"\x00" * 960, 480)


async def test_the_budget_counts_by_client_and_asks_once_per_turn_when_over() -> None:
    calls: list[int] = []
    budget = MemoryBudget(1000, lambda: calls.append(budget.total))
    budget.charge("a", 600)
    budget.charge("b", 300)
    assert not budget.over and budget.biggest_client() == "a"
    budget.charge("b", 200)  # 1100: over
    budget.charge("b", 200)  # still over: no second call scheduled
    assert budget.over and calls == []  # never in the middle of the charging caller
    await asyncio.sleep(0)
    assert calls == [1300] and budget.biggest_client() == "b"
    budget.charge("b", -700)
    budget.charge("a", -600)
    assert budget.total == 0 and budget.biggest_client() is None and budget.of("b") == 0
    unlimited = MemoryBudget(0, lambda: calls.append(-1))
    unlimited.charge("a", 10**12)
    await asyncio.sleep(0)
    assert not unlimited.over and calls == [1300]


def test_an_outbox_charges_what_it_holds_and_gives_it_all_back() -> None:
    charged: list[int] = []
    box = Outbox(
        sample_rate=24000,
        max_unsent_s=60.0,
        replay_max_s=0.1,
        replay_max_bytes=1 << 20,
        charge=charged.append,
    )
    box.on_segment("one")
    box.on_frames([FRAME] * 3, 1440)
    per_frame = ITEM_OVERHEAD_BYTES + 960
    assert sum(charged) == box.charged_bytes == 3 * per_frame + ITEM_OVERHEAD_BYTES + len("one")
    box.mark_sent(box.end_index)  # sent: the replay bound (0.1 s = 5 frames) may now evict
    box.on_frames([FRAME] * 6, 2880)
    assert box.start_index > 0 and sum(charged) == box.charged_bytes  # evictions are given back
    box.finish("complete", [])
    box.release()
    assert sum(charged) == 0 == box.charged_bytes and box.ready(box.start_index) == []
    box.on_frames([FRAME], 480)  # a freed stream's late audio is not kept
    assert sum(charged) == 0
