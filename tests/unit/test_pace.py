"""The server's pace and its buffer advice (``server/streams/pace.py``), without a server.

The buffer figure is checked against the harness's listener model (``bench.harness.listener``):
audio made at ``1/r`` seconds a second in blocks, a listener starting on the advice plays it
through. The pace is fed through the same collectors the engine core observes.
"""

from __future__ import annotations

import pytest

from bench.harness.listener import simulate
from server.metrics import Metrics
from server.streams.pace import LENGTH_MARGIN, RTF_MARGIN, Pace, buffer_s, per_second

TOKEN_S = 512 / 24_000  # audio of one token
BLOCK = 32  # tokens of the schedule's largest block


def arrivals(rtf: float, length_s: float, block_s: float) -> list[tuple[float, float]]:
    """Blocks of ``block_s`` (the last one shorter) arriving as an engine at ``rtf`` makes them."""
    out, made = [], 0.0
    while made < length_s - 1e-9:
        audio = min(block_s, length_s - made)
        made += audio
        out.append((rtf * made, audio))
    return out


@pytest.mark.parametrize("rtf", [0.5, 0.9, 1.0, 1.3, 2.0, 3.5])
@pytest.mark.parametrize("length_s", [0.5, 3.0, 20.0])
def test_a_listener_starting_on_the_advice_never_stalls(rtf: float, length_s: float) -> None:
    block_s = BLOCK * TOKEN_S
    advice = buffer_s(rtf, length_s, block_s)
    assert advice <= length_s  # never more than the stream
    result = simulate(arrivals(rtf, length_s, block_s), advice)
    assert result.underruns == 0, (rtf, length_s, advice)


@pytest.mark.parametrize("rtf", [1.5, 2.0, 3.5])
def test_the_length_term_is_needed_when_slower_than_real_time(rtf: float) -> None:
    block_s, length_s = BLOCK * TOKEN_S, 20.0
    blocks_only = buffer_s(rtf, None, block_s)  # what a fixed, length-blind buffer would hold
    assert simulate(arrivals(rtf, length_s, block_s), blocks_only).underruns > 0
    assert simulate(arrivals(rtf, length_s, block_s), 0.8 * buffer_s(rtf, length_s, block_s)).underruns > 0
    assert per_second(rtf) == pytest.approx(1 - 1 / rtf) and per_second(0.7) == 0


def step(metrics: Metrics, rows: int, seconds_per_token_step: float, blocks: int = 8) -> None:
    """What the engine core observes for ``blocks`` steps of ``BLOCK`` tokens over ``rows`` rows."""
    for _ in range(blocks):
        metrics.block_time.observe(seconds_per_token_step * BLOCK)
        metrics.batch_size.observe(rows)
        metrics.block_tokens.observe(BLOCK)
        metrics.tokens.inc(rows * BLOCK)
        metrics.audio_seconds.inc(rows * BLOCK * TOKEN_S)


def calibrated(
    *points: tuple[int, float], text: str = "x" * 100, audio_s: float = 10.0
) -> tuple[Metrics, Pace]:
    """A pace calibrated as a warm-up does: per phase, its steps at ``(rows, token-step in TOKEN_S)``."""
    metrics = Metrics()
    pace = Pace(metrics, sample_every_s=0)
    for rows, token_steps in points:
        step(metrics, rows=rows, seconds_per_token_step=token_steps * TOKEN_S)
        pace.calibrate([text], audio_s=audio_s)
    return metrics, pace


def test_nothing_measured_no_advice() -> None:
    assert Pace(Metrics()).advice("some text") is None


def test_the_advice_follows_the_measured_steps_and_the_rows_a_stream_joins() -> None:
    # The last window: one row; 0.1 s of audio a letter (12 speech tokens).
    metrics, pace = calibrated((4, 1.6), (1, 0.8))
    assert pace.rtf(1) == pytest.approx(RTF_MARGIN * 0.8)
    assert pace.rtf(4) == pytest.approx(RTF_MARGIN * 1.6)
    assert pace.rtf(8) > pace.rtf(4)  # beyond the points: the line's slope, never flat or faster

    metrics.running_sequences.set(0)
    metrics.queue_depth.set(1)  # the stream being opened, submitted: it runs alone
    alone = pace.advice("y" * 50)
    assert alone is not None and alone.expected_rtf == pytest.approx(RTF_MARGIN * 0.8)
    metrics.running_sequences.set(3)  # three rows run: the stream shares its steps with them
    shared = pace.advice("y" * 50)
    assert shared is not None and shared.expected_rtf == pytest.approx(RTF_MARGIN * 1.6)
    length = LENGTH_MARGIN * 0.1 * 50  # 50 letters
    assert shared.buffer_ms == pytest.approx(
        1000 * buffer_s(shared.expected_rtf, length, BLOCK * TOKEN_S), abs=1
    )
    assert shared.buffer_ms_per_s == pytest.approx(1000 * (1 - 1 / shared.expected_rtf), abs=1)
    later = pace.advice()  # text still to come: the block term, and what a second adds
    assert later is not None and later.buffer_ms < shared.buffer_ms
    assert set(shared.fields()) == {"expected_rtf", "buffer_ms", "buffer_ms_per_s"}


def test_streams_the_front_end_holds_count_before_the_engine_gauges_see_them() -> None:
    # A burst of eight starts: the engine core has not yet counted them (its gauges say one
    # queued), but the front end holds eight generating. Advised at one row's pace, the
    # first of the burst stalled once all eight shared the steps.
    metrics, pace = calibrated((4, 1.6), (1, 0.8))
    metrics.running_sequences.set(0)
    metrics.queue_depth.set(1)
    by_gauges = pace.advice("y" * 50)
    burst = pace.advice("y" * 50, open_streams=8)
    assert by_gauges is not None and burst is not None
    assert burst.expected_rtf == pytest.approx(pace.rtf(8)) and burst.expected_rtf > by_gauges.expected_rtf
    assert burst.buffer_ms > by_gauges.buffer_ms
    greeting = pace.advice(joining=True, open_streams=8)  # hello: for a ninth
    assert greeting is not None and greeting.expected_rtf == pytest.approx(pace.rtf(9))


def test_the_warm_up_s_last_phase_is_not_taken_for_traffic() -> None:
    # The warm-up ends with eight streams together: a point at eight rows, but the first client
    # after it runs alone and is advised one row's pace.
    metrics, pace = calibrated((1, 0.8), (8, 2.0))
    assert pace.rtf(8) == pytest.approx(RTF_MARGIN * 2.0)
    metrics.queue_depth.set(1)
    first = pace.advice("y" * 50, open_streams=1)
    assert first is not None and first.expected_rtf == pytest.approx(pace.rtf(1))


def test_a_machine_that_slows_down_is_followed_at_the_next_window() -> None:
    metrics, pace = calibrated((2, 0.5), (1, 0.5), text="x", audio_s=0.1)
    assert pace.rtf(1) == pytest.approx(RTF_MARGIN * 0.5)
    step(metrics, rows=1, seconds_per_token_step=2.0 * TOKEN_S)  # a neighbour took the CPU
    assert pace.advice() is not None  # an advice reads the new window
    assert pace.rtf(1) == pytest.approx(RTF_MARGIN * 2.0)
    assert pace.rtf(2) >= pace.rtf(1)  # the stale point at 2 rows never makes more rows faster
    step(metrics, rows=1, seconds_per_token_step=9.0 * TOKEN_S, blocks=2)  # too few steps to say
    pace.advice()
    assert pace.rtf(1) == pytest.approx(RTF_MARGIN * 2.0)


def test_the_start_up_line_says_the_pace_at_one_stream() -> None:
    metrics = Metrics()
    pace = Pace(metrics, sample_every_s=0)
    assert "no step measured" in pace.expectation("fake")
    step(metrics, rows=1, seconds_per_token_step=1.5 * TOKEN_S)
    pace.calibrate(["x"], 0.1)
    line = pace.expectation("chattts (cpu, bfloat16, compiled, w8a8)")
    assert line.startswith("chattts (cpu, bfloat16, compiled, w8a8): 32.0 ms a token step at 1 stream")
    assert f"expected RTF {RTF_MARGIN * 1.5:.2f}" in line and "slower than real time" in line


def test_the_length_of_a_text_is_foreseen_from_the_wordier_phase_of_the_warm_up() -> None:
    metrics = Metrics()
    pace = Pace(metrics, sample_every_s=0)
    step(metrics, rows=1, seconds_per_token_step=0.5 * TOKEN_S)
    pace.calibrate(["x" * 10], audio_s=1.2)  # 10 letters: 0.01 s a speech token
    step(metrics, rows=2, seconds_per_token_step=0.5 * TOKEN_S)
    pace.calibrate(["你好"], audio_s=0.24)  # 2 characters (48 units): 0.005 s, less
    assert pace.audio_s_per_speech_token == pytest.approx(0.01)  # the larger: never foreseen shorter


def test_advices_read_the_collectors_at_most_every_sample_interval() -> None:
    metrics = Metrics()
    now = [100.0]
    pace = Pace(metrics, sample_every_s=0.25, clock=lambda: now[0])
    step(metrics, rows=1, seconds_per_token_step=0.5 * TOKEN_S)
    pace.calibrate(["x"], 0.1)
    assert pace.advice() is not None  # the first advice reads (an empty window)
    step(metrics, rows=1, seconds_per_token_step=2.0 * TOKEN_S)  # the machine slowed
    pace.advice()
    assert pace.rtf(1) == pytest.approx(RTF_MARGIN * 0.5)  # within the interval: not read again
    now[0] += 0.25
    pace.advice()
    assert pace.rtf(1) == pytest.approx(RTF_MARGIN * 2.0)  # the interval passed: the new window
