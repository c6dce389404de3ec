"""The harness's audio cap on a server stream: what it credits, which ``bench.baselines.engine`` matches.

``--max-audio-s`` cancels a stream at the frame that reaches the cap; the client library ends
the iteration there and drops what the server still sends of that block. So a capped stream
is credited exactly the cap (a whole number of 20 ms frames here), and the in-process engine,
whose job would otherwise keep the rest of its last block, is credited the same
(``test_bench_engine_direct.py``).
"""

from __future__ import annotations

import asyncio

from bench.harness.client import StreamOptions, run_stream
from bench.harness.servers import ServerProcess
from bench.harness.textset import BenchText, Job


async def test_a_capped_stream_is_credited_exactly_its_cap() -> None:
    # Fake engine blocks of 32 tokens (16 384 samples): the cap falls inside a block, and the
    # server sends the block's frames past it before the cancel arrives.
    server = ServerProcess(["--engine", "fake", "--block-schedule", "32"])
    await server.start(timeout_s=60)
    try:
        text = BenchText(text="A sentence that keeps the fake engine talking. " * 12, lang="en", size="long")
        options = StreamOptions(max_audio_s=0.5, timeout_s=30)
        async with asyncio.timeout(60):
            record = await run_stream(server.url, Job(index=0, text=text, seed=1), options)
    finally:
        await server.stop()
    assert record.ok and record.capped and not record.errors
    assert record.samples == 12_000  # 0.5 s at 24 kHz: 25 frames, none of the rest of the block
