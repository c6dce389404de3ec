"""What the engine core records: the collectors it moves, as a protocol.

In one process the core moves the server's own Prometheus collectors
(:class:`server.metrics.Metrics` satisfies :class:`CoreMetrics`). In an engine
process of its own it moves a recorder instead (``server.core.remote.recorder``), whose
operations travel with the core's events and are replayed on the front end's collectors:
``/metrics`` and the pace (``server.streams.pace``) read the same collectors either way.
"""

# ruff: noqa: D102  (each collector is documented where it is made: server.metrics.Metrics)

from __future__ import annotations

from typing import Protocol


class Observes(Protocol):
    """A histogram."""

    def observe(self, amount: float) -> None:
        """Count one value."""


class Increments(Protocol):
    """A counter."""

    def inc(self, amount: float = 1) -> None:
        """Add ``amount``."""


class Sets(Protocol):
    """A gauge."""

    def set(self, value: float) -> None:
        """Set it to ``value``."""


class LabelledIncrements(Protocol):
    """A counter with labels."""

    def labels(self, *labelvalues: str) -> Increments:
        """The counter of these label values."""


class CoreMetrics(Protocol):
    """The collectors :class:`~server.core.engine_core.EngineCore` moves (names as in ``Metrics``)."""

    @property
    def block_time(self) -> Observes: ...
    @property
    def batch_size(self) -> Observes: ...
    @property
    def block_tokens(self) -> Observes: ...
    @property
    def queue_wait(self) -> Observes: ...
    @property
    def tokens(self) -> Increments: ...
    @property
    def audio_seconds(self) -> Increments: ...
    @property
    def engine_failures(self) -> LabelledIncrements: ...
    @property
    def kv_cache_bytes(self) -> Sets: ...
    @property
    def gpu_memory_bytes(self) -> Sets: ...
    @property
    def kv_resident_bytes(self) -> Sets: ...
    @property
    def running_sequences(self) -> Sets: ...
    @property
    def breaker_open(self) -> Sets: ...
    @property
    def engine_host_cpu(self) -> Sets: ...
    @property
    def engine_host_held(self) -> Sets: ...


#: Every collector of :class:`CoreMetrics`, by kind (what a recorder may replay, and how).
OBSERVED = ("block_time", "batch_size", "block_tokens", "queue_wait")
INCREMENTED = ("tokens", "audio_seconds", "engine_failures")
SET = (
    "kv_cache_bytes",
    "gpu_memory_bytes",
    "kv_resident_bytes",
    "running_sequences",
    "breaker_open",
    "engine_host_cpu",
    "engine_host_held",
)
