"""The server's pace, and the audio a listener should buffer to play a stream without a stall.

A listener plays audio at real time from the moment it starts; the server makes it at its
own pace, in blocks. When the engine is slower than real time for a stream (expected RTF
``r`` above 1), a fixed jitter buffer runs dry: a stream of ``L`` seconds ends ``L·r``
after its first audio while playing it takes ``L``, so the listener must hold back about
``L·(1 − 1/r)`` seconds before it starts. :class:`Pace` estimates ``r`` for a new stream
from what the engine measured and turns it into that buffer (:func:`buffer_s`), which
``started`` and ``hello`` carry (docs/protocol.md, "How much to buffer").

What is measured (nothing here touches the inference thread): the engine core's own
collectors in ``/metrics`` (``chattts_block_seconds``, ``chattts_block_tokens``,
``chattts_batch_size``, ``chattts_tokens_generated``, ``chattts_audio_generated_seconds``),
read as totals at two moments. Between them: seconds per token step (a block's wall time
over its token steps), the mean rows of a step, audio seconds per token. Each window of at
least :data:`MIN_STEPS` steps is one point: seconds per token step at its mean rows
(rounded), the newest point at each row count kept (at most :data:`MAX_POINTS` of them, so
a machine that slows down is followed at the next window). Between and beyond them the
pace is a line in rows (never faster with more rows), so a stream expected to share its
steps with more rows is expected slower. The warm-up runs one stream alone, then two
together (``server.core.warmup``), so the first client already has two points, and how
much audio the text's words make (audio seconds per unit of
:func:`~server.engine_api.speech_tokens`, the language-weighted measure of a text's words
the engine's token caps use: a CJK character weighs two Latin letters) to foresee a
stream's length from its text.

Bounded: a fixed number of points, a few floats; nothing grows with traffic.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from server.engine_api import speech_tokens
from server.metrics import Metrics

#: A window shorter than this many engine steps says too little to be a point.
MIN_STEPS = 4
#: How many row counts keep their newest point (the oldest updated is forgotten first).
MAX_POINTS = 16
#: An advice reads the collectors at most this often: reading five histograms is a measurable
#: share of a stream's start when hundreds start a second (bench/results/harness/frontend-cost-*),
#: and a window this short holds too few steps to be a point anyway.
SAMPLE_EVERY_S = 0.25
#: The RTF is taken this much slower than measured: steps vary, and the core's own work
#: between steps (commands, events) is not in a step's wall time.
RTF_MARGIN = 1.15
#: A stream's length foreseen from its text is taken this much longer (speech length varies).
LENGTH_MARGIN = 1.25
#: Before warm-up measured it: ``speech_tokens`` counts audio tokens (21.3 ms) at a third of
#: an ordinary speaking rate, so about a third of a token's audio a unit.
DEFAULT_AUDIO_S_PER_SPEECH_TOKEN = 512 / 24_000 / 3
#: Added to every buffer: a block's audio reaches the listener a little after the step that
#: made it (events, encoding, the network), and a figure exactly at the boundary stalls.
JITTER_S = 0.05
#: No advice asks for more than ten minutes of audio (a listener of a longer, slower stream
#: may still stall once).
MAX_BUFFER_S = 600.0


@dataclass(frozen=True, slots=True)
class _Totals:
    """The engine core's running totals at one moment."""

    step_s: float  # wall time of every step
    token_steps: float  # token steps of every step (the longest row's)
    rows: float  # rows of every step, summed
    steps: float
    tokens: float  # tokens of every row
    audio_s: float
    largest_block: float  # token steps of the largest block seen (a histogram bound)


def _totals(metrics: Metrics) -> _Totals:
    values: dict[str, float] = {}
    buckets: list[tuple[float, float]] = []  # chattts_block_tokens: (upper bound, blocks at most it)
    collectors = (metrics.block_time, metrics.block_tokens, metrics.batch_size, metrics.tokens)
    for collector in (*collectors, metrics.audio_seconds):
        for family in collector.collect():
            for sample in family.samples:
                values[sample.name] = sample.value
                if sample.name == "chattts_block_tokens_bucket" and sample.labels["le"] != "+Inf":
                    buckets.append((float(sample.labels["le"]), sample.value))
    count = values.get("chattts_block_tokens_count", 0.0)
    # The lowest bucket that holds every block bounds the largest block.
    largest = next((bound for bound, blocks in buckets if blocks >= count), 0.0)
    return _Totals(
        step_s=values.get("chattts_block_seconds_sum", 0.0),
        token_steps=values.get("chattts_block_tokens_sum", 0.0),
        rows=values.get("chattts_batch_size_sum", 0.0),
        steps=values.get("chattts_batch_size_count", 0.0),
        tokens=values.get("chattts_tokens_generated_total", 0.0),
        audio_s=values.get("chattts_audio_generated_seconds_total", 0.0),
        largest_block=largest,
    )


def _gauge(metrics: Metrics, name: str) -> float:
    gauge = getattr(metrics, name)
    return float(sum(s.value for family in gauge.collect() for s in family.samples))


def buffer_s(rtf: float, length_s: float | None, block_s: float) -> float:
    """Audio to hold before playing so that a stream of ``length_s`` seconds never stalls.

    The engine makes audio at ``1/r`` seconds a second (``r``: ``rtf``), in blocks of up
    to ``b`` (``block_s``) seconds. Started on ``X`` seconds, the listener plays block
    ``k + 1`` on time when ``X ≥ S(k+1) − S(k)/r`` (``S(k)``: the audio of the first ``k``
    blocks) for every block after the start. The next block asks ``X ≥ r·b``; when
    ``r > 1`` the last one asks more, ``X ≥ (L − b)·(1 − 1/r) + b``. Never more than the
    stream itself. ``length_s`` None (text still to come): the block term alone, and
    :func:`per_second` says what each second of audio adds. Plus :data:`JITTER_S`.
    """
    need = rtf * block_s + JITTER_S
    if length_s is not None:
        if rtf > 1.0:
            need = max(need, (length_s - block_s) * (1.0 - 1.0 / rtf) + block_s + JITTER_S)
        need = min(need, length_s)
    return min(max(0.0, need), MAX_BUFFER_S)


def per_second(rtf: float) -> float:
    """The buffer each further second of audio needs (0 when faster than real time)."""
    return max(0.0, 1.0 - 1.0 / rtf)


def _interpolate(points: dict[int, float], rows: float) -> float:
    """The pace at ``rows`` on the line through the nearest points (flat with one point).

    Beyond the points the line keeps the slope of the last two, at least 0 (more rows never
    make a step faster).
    """
    keys = sorted(points)
    if len(keys) == 1:
        return points[keys[0]]
    below = [k for k in keys if k <= rows]
    above = [k for k in keys if k > rows]
    if below and above:
        x0, x1 = below[-1], above[0]
    elif above:  # below the fewest rows measured
        x0, x1 = keys[0], keys[1]
    else:
        x0, x1 = keys[-2], keys[-1]
    slope = max(0.0, (points[x1] - points[x0]) / (x1 - x0))
    return max(points[x0] + slope * (rows - x0), min(points.values()))


@dataclass(frozen=True, slots=True)
class Advice:
    """What a listener of one stream should expect.

    Attributes:
        expected_rtf: wall seconds the server expects to take per second of the stream's audio.
        buffer_ms: audio to hold before starting playback (the whole stream, when its text
            is known; else the block granularity only).
        buffer_ms_per_s: what each further second of audio adds to ``buffer_ms`` (0 when
            the stream is expected faster than real time): for text not yet sent.
    """

    expected_rtf: float
    buffer_ms: int
    buffer_ms_per_s: int

    def fields(self) -> dict[str, float | int]:
        """The wire fields of ``started`` and ``hello``."""
        return {
            "expected_rtf": round(self.expected_rtf, 2),
            "buffer_ms": self.buffer_ms,
            "buffer_ms_per_s": self.buffer_ms_per_s,
        }


class Pace:
    """The engine's pace, from its measured steps; the buffer advice for a new stream."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        sample_every_s: float = SAMPLE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._last = _totals(metrics)
        self._sample_every_s, self._clock = sample_every_s, clock
        self._sampled_at = -math.inf  # when an advice last read the collectors
        #: Seconds per token step by rows, newest last (insertion order is update order).
        self._points: dict[int, float] = {}
        self._audio_s_per_token: float | None = None
        self._block_tokens = 0.0
        self._recent_rows = 1.0  # the last window's mean rows
        #: Audio seconds a unit of ``speech_tokens`` made at warm-up (the default before).
        self.audio_s_per_speech_token = DEFAULT_AUDIO_S_PER_SPEECH_TOKEN
        self._calibrated = False

    # --- measuring -----------------------------------------------------------------------

    def sample(self, *, force: bool = False) -> None:
        """Take the window since the last sample as a point (when it held enough steps).

        ``force``: take it with any number of steps (a warm-up phase that ended).
        """
        now = _totals(self._metrics)
        last = self._last
        steps = now.steps - last.steps
        if steps < (1 if force else MIN_STEPS):
            return
        self._last = now
        token_steps = now.token_steps - last.token_steps
        tokens = now.tokens - last.tokens
        if token_steps <= 0 or tokens <= 0:
            return
        rows = max(1, round((now.rows - last.rows) / steps))
        self._points.pop(rows, None)
        self._points[rows] = (now.step_s - last.step_s) / token_steps
        if len(self._points) > MAX_POINTS:
            del self._points[next(iter(self._points))]
        self._recent_rows = (now.rows - last.rows) / steps
        self._audio_s_per_token = (now.audio_s - last.audio_s) / tokens or self._audio_s_per_token
        self._block_tokens = max(self._block_tokens, now.largest_block)

    def calibrate(self, texts: Sequence[str], audio_s: float) -> None:
        """A warm-up phase ended: its steps become a point; ``texts`` spoke ``audio_s`` seconds.

        The audio a unit of text makes is the largest of the phases' (languages differ; a
        stream foreseen longer is only advised a larger buffer).
        """
        self.sample(force=True)
        # A warm-up phase's rows are not traffic a new stream will join: the first client after
        # a burst phase runs alone.
        self._recent_rows = 1.0
        units = sum(speech_tokens(text) for text in texts)
        if units > 0 and audio_s > 0:
            measured = audio_s / units
            known = self.audio_s_per_speech_token if self._calibrated else 0.0
            self.audio_s_per_speech_token, self._calibrated = max(known, measured), True

    @property
    def known(self) -> bool:
        """Whether anything was measured yet (no advice before)."""
        return bool(self._points) and self._audio_s_per_token is not None

    def seconds_per_token_step(self, rows: float) -> float:
        """A token step's expected wall time with ``rows`` rows (the fitted line)."""
        return _interpolate(self._points, rows)

    def rtf(self, rows: float) -> float:
        """The expected RTF of one row among ``rows`` (with :data:`RTF_MARGIN`)."""
        assert self._audio_s_per_token is not None
        return RTF_MARGIN * self.seconds_per_token_step(rows) / self._audio_s_per_token

    # --- advising ------------------------------------------------------------------------

    def expected_rows(self, *, joining: bool, open_streams: int = 0) -> float:
        """Rows a stream opened now shares its steps with.

        The largest of: the running and waiting ones by the engine core's gauges; the streams
        the front end holds open (``open_streams``, which the gauges have not all seen yet
        when many start at once); each plus one when ``joining`` (a stream not yet opened);
        and the last window's mean (streams that will join it). Streams that start together
        count each other: without the front end's count, the first of a burst of eight were
        advised the pace of one row and stalled at eight's (bench/results/harness/buffer-advice-*).
        """
        now = _gauge(self._metrics, "running_sequences") + _gauge(self._metrics, "queue_depth")
        join = 1.0 if joining else 0.0
        return max(1.0, now + join, open_streams + join, self._recent_rows)

    def advice(
        self, text: str | None = None, *, joining: bool = False, open_streams: int = 0
    ) -> Advice | None:
        """What a listener of a stream opened now should expect (None: nothing measured yet).

        ``text``: the stream's whole text (its length foreseen from it); None for text still
        to come (incremental) or ``hello``'s server-wide figure. ``open_streams``: the streams
        the front end holds that are still generating (the new one among them, once opened).
        """
        if self._clock() - self._sampled_at >= self._sample_every_s:
            self._sampled_at = self._clock()
            self.sample()
        if not self.known:
            return None
        assert self._audio_s_per_token is not None
        rtf = self.rtf(self.expected_rows(joining=joining, open_streams=open_streams))
        length = None
        if text:
            length = LENGTH_MARGIN * self.audio_s_per_speech_token * speech_tokens(text)
        block_s = max(self._block_tokens, 1.0) * self._audio_s_per_token
        return Advice(
            expected_rtf=rtf,
            buffer_ms=math.ceil(1000.0 * buffer_s(rtf, length, block_s)),
            buffer_ms_per_s=math.ceil(1000.0 * per_second(rtf)),
        )

    def expectation(self, engine: str) -> str:
        """The start-up log line: what runs, and what a listener should expect on this machine."""
        if not self.known:
            return f"{engine}: no step measured (warm-up off?): no buffer advice until streams run"
        one = self.rtf(1.0)
        step_ms = 1000.0 * self.seconds_per_token_step(1.0)
        buffer_ms = 1000.0 * per_second(one)
        pace = "real time" if one <= 1.0 else f"slower than real time: buffer {buffer_ms:.0f} ms a second"
        return (
            f"{engine}: {step_ms:.1f} ms a token step at 1 stream, expected RTF {one:.2f} "
            f"({pace}); {1000 * self.audio_s_per_speech_token * 12:.0f} ms of audio a Latin letter"
        )
