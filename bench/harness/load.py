"""Load generators: closed loop (N streams always in flight) and open loop (Poisson arrivals).

Both are bounded in time (``duration_s``: no new stream after it) and count
(``max_streams``), and cut streams still running ``grace_s`` after the
last arrival. Every task is owned by a ``TaskGroup``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from bench.harness.latency import StreamRecord
from bench.harness.textset import BenchText, Job, job

#: Runs one job; ``stop`` asks it to cancel its stream.
StreamRunner = Callable[[Job, asyncio.Event], Awaitable[StreamRecord]]


@dataclass(frozen=True)
class LoadSpec:
    """One load scenario.

    Attributes:
        mode: ``closed`` or ``open``.
        concurrency: streams in flight (closed loop).
        rate: mean arrivals per second (open loop).
        duration_s: no stream starts after this many seconds.
        max_streams: no more than this many streams in total.
        grace_s: after the last arrival, streams still running this long are cut.
        seed: seeds the Poisson arrivals.
        seed_base: the first job's sampling seed (see :func:`bench.harness.textset.seed_base`).
    """

    mode: str
    concurrency: int = 1
    rate: float = 0.0
    duration_s: float = 20.0
    max_streams: int = 1000
    grace_s: float = 60.0
    seed: int = 1
    seed_base: int = 0

    @property
    def label(self) -> str:
        """``c4`` or ``r1.5``."""
        return f"c{self.concurrency}" if self.mode == "closed" else f"r{self.rate:g}"


@dataclass
class LoadRun:
    """The records of one scenario and its time window.

    Attributes:
        records: one per stream, in completion order.
        t_start: when the first stream was issued.
        t_stop: when the offered load stopped being held (closed loop: when
            the first worker left, i.e. until then all N streams were in
            flight; open loop: the deadline, or the last arrival when the
            count ran out).
        t_end: when the last stream ended.
    """

    records: list[StreamRecord] = field(default_factory=list)
    t_start: float = 0.0
    t_stop: float = 0.0
    t_end: float = 0.0


async def _cut_after(stop: asyncio.Event, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    stop.set()


async def closed_loop(texts: list[BenchText], spec: LoadSpec, runner: StreamRunner) -> LoadRun:
    """``spec.concurrency`` workers, each running jobs back to back until the scenario is over."""
    run = LoadRun(t_start=time.perf_counter())
    deadline = run.t_start + spec.duration_s
    stop = asyncio.Event()
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while time.perf_counter() < deadline and next_index < spec.max_streams and not stop.is_set():
            index = next_index
            next_index += 1
            run.records.append(await runner(job(texts, index, spec.seed_base), stop))
        if not run.t_stop:  # the first worker to leave ends the window with all N streams in flight
            run.t_stop = time.perf_counter()

    async with asyncio.TaskGroup() as group:
        workers = [group.create_task(worker()) for _ in range(spec.concurrency)]
        cutter = group.create_task(_cut_after(stop, spec.duration_s + spec.grace_s))
        await asyncio.gather(*workers)
        cutter.cancel()
    run.t_end = time.perf_counter()
    return run


def poisson_arrivals(rate: float, duration_s: float, max_streams: int, seed: int) -> list[float]:
    """Arrival offsets (seconds from the start) of a Poisson process: first at 0, then exponential gaps."""
    rng = random.Random(seed)
    arrivals: list[float] = []
    at = 0.0
    while len(arrivals) < max_streams and at < duration_s:
        arrivals.append(at)
        at += rng.expovariate(rate)
    return arrivals


async def open_loop(texts: list[BenchText], spec: LoadSpec, runner: StreamRunner) -> LoadRun:
    """Poisson arrivals at ``spec.rate`` per second; each arrival runs one job on its own."""
    arrivals = poisson_arrivals(spec.rate, spec.duration_s, spec.max_streams, spec.seed)
    run = LoadRun(t_start=time.perf_counter())
    stop = asyncio.Event()

    async def one(index: int) -> None:
        run.records.append(await runner(job(texts, index, spec.seed_base), stop))

    async with asyncio.TaskGroup() as group:
        streams: list[asyncio.Task[None]] = []
        for index, offset in enumerate(arrivals):
            await asyncio.sleep(max(0.0, run.t_start + offset - time.perf_counter()))
            streams.append(group.create_task(one(index)))
        count_ran_out = len(arrivals) >= spec.max_streams
        run.t_stop = run.t_start + (arrivals[-1] if count_ran_out else spec.duration_s)
        cut_in = max(0.0, run.t_stop - time.perf_counter()) + spec.grace_s
        cutter = group.create_task(_cut_after(stop, cut_in))
        await asyncio.gather(*streams)
        cutter.cancel()
    run.t_end = time.perf_counter()
    return run


async def run_load(texts: list[BenchText], spec: LoadSpec, runner: StreamRunner) -> LoadRun:
    """Run ``spec`` with the matching generator."""
    if spec.mode == "closed":
        return await closed_loop(texts, spec, runner)
    if spec.mode == "open":
        if spec.rate <= 0:
            raise ValueError("open loop needs a positive rate")
        return await open_loop(texts, spec, runner)
    raise ValueError(f"unknown load mode {spec.mode!r}")
