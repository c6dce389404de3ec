"""Prometheus collectors, one registry per server instance (tests run several).

Under ``--frontend-processes N`` each front-end process is started with
``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode, chosen when it is
imported): every process writes its values to files there, and :meth:`Metrics.render` in any
of them merges all (counters and histograms summed; each gauge by its mode below: a sum over
the live processes, or their largest value for the engine's gauges, which only the process
that receives the engine's metrics sets). ``Info`` has no multiprocess form: it is rendered
from this process (every process loads the same engine).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

#: The variable prometheus_client reads at import time; set by the supervisor for its children.
MULTIPROC_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
_BLOCK_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


class Metrics:
    """Every collector the server exports at ``GET /metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.connections = Gauge(
            "chattts_connections", "Open WebSocket connections", registry=r, multiprocess_mode="livesum"
        )
        self.active_streams = Gauge(
            "chattts_active_streams", "Streams not yet done", registry=r, multiprocess_mode="livesum"
        )
        self.queue_depth = Gauge(
            "chattts_queue_depth",
            "Sequences waiting for a batch slot",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.running_sequences = Gauge(
            "chattts_running_sequences",
            "Sequences in the current batch",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.frames_sent = Counter("chattts_frames_sent", "Binary audio frames sent", registry=r)
        self.bytes_sent = Counter("chattts_audio_bytes_sent", "Audio frame bytes sent", registry=r)
        self.streams_total = Counter("chattts_streams", "Streams by end reason", ["reason"], registry=r)
        self.errors = Counter("chattts_errors", "Error messages sent, by code", ["code"], registry=r)
        self.resumes = Counter(
            "chattts_resumes",
            "Resumes by how they were served: local, forwarded, regenerated, degraded, unknown",
            ["how"],
            registry=r,
        )
        self.forwarded_streams = Gauge(
            "chattts_forwarded_streams",
            "Streams relayed from their owner replica now",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.time_to_first_audio = Histogram(
            "chattts_time_to_first_audio_seconds",
            "From a start message to its first audio frame handed to the socket",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "chattts_batch_size", "Sequences per engine step", buckets=_BATCH_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "chattts_queue_wait_seconds",
            "From submission to a sequence's first engine step",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.block_time = Histogram(
            "chattts_block_seconds", "Wall time of one engine step", buckets=_LATENCY_BUCKETS, registry=r
        )
        # Token steps per engine step: a block ends early (below the schedule's 32) when a newcomer,
        # an append or a cancel waits; many short blocks spend their time on per-block work.
        self.block_tokens = Histogram(
            "chattts_block_tokens",
            "Token steps in one engine step (the longest row's)",
            buckets=_BLOCK_TOKEN_BUCKETS,
            registry=r,
        )
        self.tokens = Counter("chattts_tokens_generated", "Audio tokens generated", registry=r)
        self.audio_seconds = Counter(
            "chattts_audio_generated_seconds", "Seconds of audio generated", registry=r
        )
        self.engine_failures = Counter(
            "chattts_engine_failures", "Failed engine steps, by kind", ["kind"], registry=r
        )
        self.breaker_open = Gauge(
            "chattts_breaker_open",
            "1 while the engine breaker is open",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.cache_hits = Counter(
            "chattts_cache_hits", "Streams answered from the response cache", registry=r
        )
        self.cache_misses = Counter(
            "chattts_cache_misses", "Seeded streams not in the response cache", registry=r
        )
        self.cache_bytes = Gauge(
            "chattts_cache_bytes", "Bytes held by the response cache", registry=r, multiprocess_mode="livesum"
        )
        self.buffered_bytes = Gauge(
            "chattts_buffered_bytes",
            "Bytes buffered for clients (--memory-budget-bytes bounds it)",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.engine = Info(
            "chattts_engine",
            "The loaded engine: name, device, dtype, weights (official, unverified or random)",
            registry=r,
        )
        self._own = CollectorRegistry()  # what only this process knows (no multiprocess form)
        self._own.register(self.engine)
        self.gpu_memory_bytes = Gauge(
            "chattts_gpu_memory_allocated_bytes",
            "Accelerator memory allocated (0 without one)",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.kv_cache_bytes = Gauge(
            "chattts_kv_cache_bytes",
            "KV cache the engine reserved at start-up, the most it can hold (0: none)",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.kv_resident_bytes = Gauge(
            "chattts_kv_resident_bytes",
            "KV cache in memory now: the reservation on a GPU, the live rows' positions on the CPU",
            registry=r,
            multiprocess_mode="livemax",
        )
        # The engine's host side (engines that measure it: the fake engine's --fake-host-ms): the
        # second is time its thread could have run but another thread held the GIL.
        self.engine_host_cpu = Gauge(
            "chattts_engine_host_cpu_seconds",
            "CPU time of the engine's steps on their thread",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.engine_host_held = Gauge(
            "chattts_engine_host_held_seconds",
            "Time the engine's steps were held off a core they could run on (the GIL)",
            registry=r,
            multiprocess_mode="livemax",
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of every collector (of every front-end process, merged)."""
        folder = os.environ.get(MULTIPROC_VARIABLE)
        if folder:
            merged = CollectorRegistry()
            MultiProcessCollector(merged, path=folder)  # type: ignore[no-untyped-call]
            return generate_latest(merged) + generate_latest(self._own)
        return generate_latest(self.registry)
