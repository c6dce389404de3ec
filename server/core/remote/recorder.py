"""The engine core's metrics, recorded where the core runs and replayed where ``/metrics`` is served.

:class:`MetricRecorder` satisfies :class:`~server.core.meters.CoreMetrics`; the engine process
hands its core one and sends what it recorded (:meth:`MetricRecorder.take`) in the frame of
every event batch. :func:`replay` moves the front end's collectors by it, so ``/metrics`` and
the pace read what they read in one process: histograms get every value observed, counters
their increments, gauges their last value. Bounded: between two batches the core records a
few values per step, and counters and gauges are summed and overwritten in place.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.core.meters import INCREMENTED, OBSERVED, SET
from server.metrics import Metrics


@dataclass(frozen=True, slots=True)
class MetricOps:
    """What the core recorded since the last batch: values observed, increments, gauges set."""

    observed: tuple[tuple[str, float], ...] = ()
    incremented: tuple[tuple[str, str, float], ...] = ()  # (collector, label value or "", amount)
    gauges: tuple[tuple[str, float], ...] = ()


class _Meter:
    """One collector of the recorder: records instead of counting."""

    __slots__ = ("_label", "_name", "_recorder")

    def __init__(self, recorder: MetricRecorder, name: str, label: str = "") -> None:
        self._recorder, self._name, self._label = recorder, name, label

    def observe(self, amount: float) -> None:
        self._recorder.observed.append((self._name, float(amount)))

    def inc(self, amount: float = 1) -> None:
        key = (self._name, self._label)
        counts = self._recorder.incremented
        counts[key] = counts.get(key, 0.0) + amount

    def set(self, value: float) -> None:
        self._recorder.gauges[self._name] = float(value)

    def labels(self, *labelvalues: str) -> _Meter:
        return _Meter(self._recorder, self._name, labelvalues[0] if labelvalues else "")


class MetricRecorder:
    """A :class:`~server.core.meters.CoreMetrics` that records (used on the core's thread only)."""

    def __init__(self) -> None:
        self.observed: list[tuple[str, float]] = []
        self.incremented: dict[tuple[str, str], float] = {}
        self.gauges: dict[str, float] = {}
        self.block_time = _Meter(self, "block_time")
        self.batch_size = _Meter(self, "batch_size")
        self.block_tokens = _Meter(self, "block_tokens")
        self.queue_wait = _Meter(self, "queue_wait")
        self.tokens = _Meter(self, "tokens")
        self.audio_seconds = _Meter(self, "audio_seconds")
        self.engine_failures = _Meter(self, "engine_failures")
        self.kv_cache_bytes = _Meter(self, "kv_cache_bytes")
        self.gpu_memory_bytes = _Meter(self, "gpu_memory_bytes")
        self.kv_resident_bytes = _Meter(self, "kv_resident_bytes")
        self.running_sequences = _Meter(self, "running_sequences")
        self.breaker_open = _Meter(self, "breaker_open")
        self.engine_host_cpu = _Meter(self, "engine_host_cpu")
        self.engine_host_held = _Meter(self, "engine_host_held")

    def take(self) -> MetricOps:
        """What was recorded since the last call; the recorder starts empty again."""
        ops = MetricOps(
            tuple(self.observed),
            tuple((name, label, amount) for (name, label), amount in self.incremented.items()),
            tuple(self.gauges.items()),
        )
        self.observed.clear()
        self.incremented.clear()
        self.gauges.clear()
        return ops


def replay(ops: MetricOps, metrics: Metrics) -> None:
    """Move ``metrics``' collectors as the engine process's core moved its recorder's.

    Names outside :class:`~server.core.meters.CoreMetrics` are ignored (the frame comes from our
    own child process, but nothing it says reaches any other attribute).
    """
    for name, value in ops.observed:
        if name in OBSERVED:
            getattr(metrics, name).observe(value)
    for name, label, amount in ops.incremented:
        if name in INCREMENTED:
            collector = getattr(metrics, name)
            (collector.labels(label) if label else collector).inc(amount)
    for name, value in ops.gauges:
        if name in SET:
            getattr(metrics, name).set(value)
