"""Sampling a server process while a run loads it: RSS, open fds, CPU time and ``/metrics`` gauges.

Every long run shares it (:mod:`bench.soak`, :mod:`bench.chaos`): the sampler reads the server's
RSS (psutil), its open file descriptors (``/proc/PID/fd``) and a few gauges from
``GET /metrics`` once an ``interval_s``.
"""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import psutil

#: Gauges read from ``/metrics`` at every sample (Prometheus name → sample field).
METRIC_GAUGES = {
    "chattts_active_streams": "active_streams",
    "chattts_queue_depth": "queue_depth",
    "chattts_connections": "connections",
    "chattts_running_sequences": "running_sequences",
    "chattts_cache_bytes": "cache_bytes",
}


@dataclass
class Sample:
    """One reading of the server process.

    Attributes:
        t: seconds since the load began (negative during the idle phase before it).
        phase: ``idle_before``, ``load``, ``drain`` or ``idle_after``.
        rss_bytes: resident set size.
        fds: open file descriptors (entries of ``/proc/PID/fd``).
        threads: OS threads of the process.
        cpu_s: user + system CPU seconds so far.
        requests_done: requests of the soak finished so far.
        active_streams, queue_depth, connections, running_sequences, cache_bytes: the server's gauges
            (``None`` when ``/metrics`` did not answer).
    """

    t: float
    phase: str
    rss_bytes: int
    fds: int
    threads: int
    cpu_s: float
    requests_done: int
    active_streams: float | None = None
    queue_depth: float | None = None
    connections: float | None = None
    running_sequences: float | None = None
    cache_bytes: float | None = None


def parse_metrics(text: str, names: Sequence[str]) -> dict[str, float]:
    """Values of unlabelled Prometheus samples named in ``names`` (others ignored)."""
    wanted = set(names)
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition(" ")
        if name in wanted:
            try:
                values[name] = float(rest.split()[0])
            except (ValueError, IndexError):
                continue
    return values


def fetch_metrics_text(url: str, timeout_s: float = 5.0) -> str:
    """The body of ``GET url`` (blocking; run it in a thread)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        body: bytes = response.read()
        return body.decode("utf-8", "replace")


async def read_gauges(metrics_url: str) -> dict[str, float]:
    """The :data:`METRIC_GAUGES` and cache counters from ``/metrics`` (empty when it does not answer)."""
    try:
        text = await asyncio.to_thread(fetch_metrics_text, metrics_url)
    except OSError:
        return {}
    names = [*METRIC_GAUGES, "chattts_cache_hits_total", "chattts_cache_misses_total"]
    return parse_metrics(text, names)


def count_fds(pid: int) -> int:
    """Open file descriptors of ``pid`` (Linux ``/proc``)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


class Sampler:
    """Samples one process every ``interval_s`` until stopped; owns its task.

    Args:
        pid: the server process.
        metrics_url: its ``/metrics``.
        interval_s: seconds between samples.
        progress: returns the number of requests finished so far.
    """

    def __init__(self, pid: int, metrics_url: str, interval_s: float, progress: Callable[[], int]) -> None:
        self.process = psutil.Process(pid)
        self.pid = pid
        self.metrics_url = metrics_url
        self.interval_s = interval_s
        self.progress = progress
        self.samples: list[Sample] = []
        self.phase = "idle_before"
        self.t0 = time.perf_counter()
        self._task: asyncio.Task[None] | None = None

    def now(self) -> float:
        """Seconds since the load began (``t0``)."""
        return time.perf_counter() - self.t0

    async def sample_once(self) -> Sample | None:
        """Take one sample (``None`` once the process is gone)."""
        try:
            with self.process.oneshot():
                rss = int(self.process.memory_info().rss)
                threads = int(self.process.num_threads())
                times = self.process.cpu_times()
            fds = count_fds(self.pid)
        except (psutil.Error, OSError):
            return None
        gauges = await read_gauges(self.metrics_url)
        sample = Sample(
            t=self.now(),
            phase=self.phase,
            rss_bytes=rss,
            fds=fds,
            threads=threads,
            cpu_s=float(times.user + times.system),
            requests_done=self.progress(),
            **{field: gauges.get(name) for name, field in METRIC_GAUGES.items()},
        )
        self.samples.append(sample)
        return sample

    async def _run(self) -> None:
        next_at = time.perf_counter()
        while True:
            await self.sample_once()
            next_at += self.interval_s
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))

    def start(self) -> None:
        """Start sampling in a task this object owns."""
        self._task = asyncio.create_task(self._run(), name="soak-sampler")

    async def stop(self) -> None:
        """Stop sampling and wait for the task to end."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None


# --- analysis -------------------------------------------------------------------------


def samples_as_dicts(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """Samples for the JSON file (compact: rounded times)."""
    return [{**asdict(s), "t": round(s.t, 3), "cpu_s": round(s.cpu_s, 3)} for s in samples]
