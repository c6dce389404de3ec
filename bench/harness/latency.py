"""Per-stream observations and the latency metrics derived from them.

Times are ``time.perf_counter()`` seconds in the harness process; every
metric is relative to the moment the ``start`` message was sent
(connection set-up is measured separately as ``connect_s``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.harness.listener import simulate


@dataclass
class StreamRecord:
    """Everything the harness observed about one stream.

    Attributes:
        job: index of the job (text and seed) in the scenario's job sequence.
        system: what served it (``server``, ``server-b1``, ``chattts-infer`` ...).
        fmt: audio format requested.
        text_size: ``short``/``medium``/``long`` of the text.
        text_lang: language of the text.
        sample_rate: output sample rate.
        t_connect: when connecting began (``None`` for in-process systems).
        t_send: when the request was sent (the origin of every metric).
        frames: ``(arrival time, samples)`` per audio frame, in arrival order.
        t_first_loud: arrival time of the frame holding the first non-silent sample.
        first_loud_sample: offset of that sample from the stream start.
        t_done: when ``done`` (or the end of the stream) arrived.
        reason: ``done.reason`` or ``None`` when the stream did not end normally.
        errors: error codes seen for this stream (wire codes or harness ones
            such as ``connect_failed``, ``connection_lost``, ``timeout``).
        capped: the harness cancelled the stream at its audio-length cap.
        cut: the harness cancelled the stream at the end of the scenario.
        advice_ms: the server's advice in ``started`` (``buffer_ms``: audio to hold before
            playing so the stream never stalls); ``None`` from a server without it.
    """

    job: int
    system: str
    fmt: str
    text_size: str = ""
    text_lang: str = ""
    sample_rate: int = 24_000
    t_connect: float | None = None
    t_send: float = 0.0
    frames: list[tuple[float, int]] = field(default_factory=list)
    t_first_loud: float | None = None
    first_loud_sample: int | None = None
    t_done: float | None = None
    reason: str | None = None
    errors: list[str] = field(default_factory=list)
    capped: bool = False
    cut: bool = False
    advice_ms: float | None = None

    @property
    def samples(self) -> int:
        """Audio samples received."""
        return sum(n for _, n in self.frames)

    @property
    def ok(self) -> bool:
        """Completed (or cancelled at the harness's cap) without errors."""
        return not self.errors and (self.reason == "complete" or (self.capped and self.reason == "cancelled"))


def _gaps(times: Sequence[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def stream_metrics(
    record: StreamRecord, jitter_ms: Sequence[float], advice_floor_ms: float | None = None
) -> dict[str, Any]:
    """The per-stream metrics (seconds; ``None`` where undefined).

    Keys: ``ttfa_s`` (first audio frame with samples), ``ttfs_s`` (frame
    with the first non-silent sample), ``leading_silence_s``, ``audio_s``,
    ``gen_s`` (request to last frame), ``rtf`` (``gen_s / audio_s``, below 1
    is faster than real time), ``max_gap_s`` and ``gaps_s`` (between
    consecutive frames), ``connect_s`` and, per jitter threshold,
    ``listener`` results. With ``advice_floor_ms`` also ``advised``: a listener that honours
    the server's advice, starting on ``max(advice_floor_ms, advice_ms)`` (on the floor alone
    when the server gave none, as client_py and client_js do).
    """
    t0 = record.t_send
    audio = [(t, n) for t, n in record.frames if n > 0]
    rate = float(record.sample_rate)
    audio_s = record.samples / rate
    times = [t for t, _ in audio]
    gaps = _gaps(times)
    gen_s = (times[-1] - t0) if times else None
    arrivals = [(t - t0, n / rate) for t, n in record.frames]
    listeners = [simulate(arrivals, ms / 1000.0) for ms in jitter_ms] if audio else []
    extra: dict[str, Any] = {}
    if advice_floor_ms is not None:
        threshold_ms = max(advice_floor_ms, record.advice_ms or 0.0)
        advised = simulate(arrivals, threshold_ms / 1000.0) if audio else None
        extra["advised"] = None
        if advised is not None:
            extra["advised"] = {
                "threshold_ms": threshold_ms,
                "advice_ms": record.advice_ms,
                "start_s": advised.start_s,
                "underruns": advised.underruns,
                "stall_s": advised.stall_s,
            }
    return extra | {
        "job": record.job,
        "system": record.system,
        "format": record.fmt,
        "text_size": record.text_size,
        "text_lang": record.text_lang,
        "ok": record.ok,
        "reason": record.reason,
        "errors": list(record.errors),
        "capped": record.capped,
        "cut": record.cut,
        "connect_s": (t0 - record.t_connect) if record.t_connect is not None else None,
        "ttfa_s": (times[0] - t0) if times else None,
        "ttfs_s": (record.t_first_loud - t0) if record.t_first_loud is not None else None,
        "leading_silence_s": (
            record.first_loud_sample / rate if record.first_loud_sample is not None else None
        ),
        "audio_s": audio_s,
        "frames": len(record.frames),
        "gen_s": gen_s,
        "rtf": (gen_s / audio_s) if gen_s is not None and audio_s > 0 else None,
        "max_gap_s": max(gaps) if gaps else None,
        "gaps_s": gaps,
        "listener": [
            {
                "threshold_ms": r.threshold_ms,
                "start_s": r.start_s,
                "underruns": r.underruns,
                "stall_s": r.stall_s,
            }
            for r in listeners
        ],
    }
