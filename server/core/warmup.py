"""Warm-up before ``/ready``: typical texts in each language through the real path.

The engine's own ``warmup()`` runs first on the inference thread (kernels,
allocator). Then these requests go through the engine client like any
client's, so batching, the decoder's buffers and the text path are all
exercised before a load balancer sends the first real request.

They run in three phases, one stream alone, then two together, then eight together, so
that a :class:`Calibration` (the server's pace, ``server.streams.pace``) measures the engine
at one row and at several before the first client asks how much to buffer. The eight are
there for a burst: a line through one and two rows foresaw eight rows' steps far too fast on
a CPU (the decode and the attention grow faster than that), and the first streams of a burst
of eight, advised by it, stalled (``bench/results/harness/buffer-advice-*``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Protocol

from server.core.client import EngineClient
from server.core.events import Audio
from server.core.generation import GenerateRequest, Generation
from server.engine_api import SynthesisParams

log = logging.getLogger(__name__)

#: Short, typical requests: Chinese, English, mixed with numbers.
WARMUP_TEXTS: tuple[tuple[str, ...], ...] = (
    ("你好，欢迎使用实时语音合成服务。", "今天天气很好。"),
    ("Hello, and welcome to the streaming speech server.", "Let's get started."),
    ("会议在下午三点开始，meeting room B.",),
    ("Let's get started.",),
)
#: The phases, by index into ``WARMUP_TEXTS``: English alone, then Chinese and mixed together,
#: then eight streams of one short sentence together (short: on two CPU cores each second of
#: this phase is a second before ``/ready``).
PHASES: tuple[tuple[int, ...], ...] = ((1,), (0, 2), (3,) * 8)


class Calibration(Protocol):
    """What measures the engine's pace from the warm-up (``server.streams.pace.Pace``)."""

    def calibrate(self, texts: Sequence[str], audio_s: float) -> None:
        """A phase ended: ``texts`` spoke ``audio_s`` seconds of audio."""

    def expectation(self, engine: str) -> str:
        """One line: what the engine runs and what to expect of it on this machine."""


async def warm_up(
    engine: EngineClient, calibration: Calibration | None = None, *, timeout_s: float = 600.0
) -> None:
    """Run the warm-up texts phase by phase (each phase a batch, like real traffic).

    ``calibration`` is told each phase's texts and audio, then the start-up's one line of
    what to expect is logged.
    """
    started = time.monotonic()
    rate = engine.info.sample_rate
    async with asyncio.timeout(timeout_s):
        for phase in PHASES:
            generations = [
                engine.generate(
                    GenerateRequest(segments=WARMUP_TEXTS[number], params=SynthesisParams(seed=number))
                )
                for number in phase
            ]
            samples = await asyncio.gather(*(_drain(generation) for generation in generations))
            if calibration is not None:
                texts = [text for number in phase for text in WARMUP_TEXTS[number]]
                calibration.calibrate(texts, sum(samples) / rate)
    log.info("warm-up done in %.1f s", time.monotonic() - started)
    if calibration is not None:
        log.info("%s", calibration.expectation(_engine_line(engine)))


def _engine_line(engine: EngineClient) -> str:
    """``chattts (cpu, bfloat16, compiled, w8a8)``: the engine and the facts that set its pace."""
    facts = engine.info.extra
    keys = ("device", "dtype", "token_step", "quantize")
    shown = [facts[k] for k in keys if facts.get(k, "none") != "none"]
    return f"{engine.info.name} ({', '.join(shown)})" if shown else engine.info.name


async def _drain(generation: Generation) -> int:
    """Read a generation to its end; returns its samples."""
    samples = 0
    async for event in generation:
        if isinstance(event, Audio):
            samples += len(event.samples)
    return samples
