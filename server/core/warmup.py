"""Warm-up before ``/ready``: typical texts in each language through the real path.

The engine's own ``warmup()`` runs first on the inference thread (kernels,
allocator). Then these requests go through the engine client like any
client's, so batching, the decoder's buffers and the text path are all
exercised before a load balancer sends the first real request.
"""

from __future__ import annotations

import asyncio
import logging
import time

from server.core.client import EngineClient
from server.core.generation import GenerateRequest, Generation
from server.engine_api import SynthesisParams

log = logging.getLogger(__name__)

#: Short, typical requests: Chinese, English, mixed with numbers.
WARMUP_TEXTS: tuple[tuple[str, ...], ...] = (
    ("你好，欢迎使用实时语音合成服务。", "今天天气很好。"),
    ("Hello, and welcome to the streaming speech server.", "Let's get started."),
    ("会议在下午三点开始，meeting room B.",),
)


async def warm_up(engine: EngineClient, *, timeout_s: float = 600.0) -> None:
    """Run every warm-up text together (a batch, like real traffic) and wait for all of them."""
    started = time.monotonic()
    generations = [
        engine.generate(GenerateRequest(segments=segments, params=SynthesisParams(seed=number)))
        for number, segments in enumerate(WARMUP_TEXTS)
    ]
    async with asyncio.timeout(timeout_s):
        await asyncio.gather(*(_drain(generation) for generation in generations))
    log.info("warm-up done in %.1f s", time.monotonic() - started)


async def _drain(generation: Generation) -> None:
    async for _ in generation:
        pass
