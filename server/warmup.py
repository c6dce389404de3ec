"""Warm-up before ``/ready``: typical texts in each language through the real path.

The engine's own ``warmup()`` runs first on the inference thread (kernels,
allocator). Then these requests go through the scheduler like any client's,
so batching, the decoder's buffers and the text path are all exercised
before a load balancer sends the first real request.
"""

from __future__ import annotations

import asyncio
import logging
import time

from server.engine.base import SynthesisParams
from server.scheduler import Scheduler
from server.stream_order import StreamEnded, StreamEvent

log = logging.getLogger(__name__)

#: Short, typical requests: Chinese, English, mixed with numbers.
WARMUP_TEXTS: tuple[tuple[str, ...], ...] = (
    ("你好，欢迎使用实时语音合成服务。", "今天天气很好。"),
    ("Hello, and welcome to the streaming speech server.", "Let's get started."),
    ("会议在下午三点开始，meeting room B.",),
)


async def warm_up(scheduler: Scheduler, *, timeout_s: float = 600.0) -> None:
    """Run every warm-up text together (a batch, like real traffic) and wait for all of them."""
    started = time.monotonic()
    finished: list[asyncio.Event] = []
    for number, segments in enumerate(WARMUP_TEXTS):
        event = asyncio.Event()
        finished.append(event)

        def sink(events: list[StreamEvent], event: asyncio.Event = event) -> None:
            if any(isinstance(e, StreamEnded) for e in events):
                event.set()

        scheduler.submit(list(segments), SynthesisParams(seed=number), sink)
    async with asyncio.timeout(timeout_s):
        await asyncio.gather(*(event.wait() for event in finished))
    log.info("warm-up done in %.1f s", time.monotonic() - started)
