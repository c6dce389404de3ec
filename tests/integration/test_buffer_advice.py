"""How much to buffer: the server's advice in ``started``/``hello`` and client_py honouring it.

A real server (fake engine) over real sockets. The fake engine's step sleeps, so once it is
slowed its pace is slower than real time for certain; the advice must then ask for a buffer
that covers the whole stream, and ``SpeechStream.buffered`` must hold the audio that long.
"""

from __future__ import annotations

import json
import logging
import time

import pytest

import chattts_stream_client as cs
from bench.harness.listener import simulate
from server.app import App
from server.engine.fake import SAMPLES_PER_TOKEN
from tests.integration.conftest import MakeApp, fake_engine
from tests.wsclient import open_client, recv, start

URL = "ws://127.0.0.1:{}/v1/stream"
#: The fake engine's step once slowed: 0.4 s for a block of 16 tokens (0.34 s of audio), so
#: at least RTF 1.17 (a sleep never ends early).
SLOW_STEP_S = 0.4
NOMINAL_RTF = SLOW_STEP_S / (16 * SAMPLES_PER_TOKEN / 24_000)
MEASURE = "A stream that measures the slow pace."
ADVISED = "The stream that follows it is played on the advice given."


Spoken = tuple[cs.SpeechStream, list[cs.AudioChunk], float]


async def _speak(port: int, text: str, min_buffer_ms: float) -> Spoken:
    """One stream through ``buffered``: the stream, its chunks, and when the first one was yielded."""
    async with cs.Client(URL.format(port), read_timeout=30) as client:
        stream = client.speak(text, format="pcm16", seed=1)
        await stream.start()
        chunks: list[cs.AudioChunk] = []
        first_yield = 0.0
        async for chunk in stream.buffered(min_buffer_ms):
            if not chunks:
                first_yield = time.perf_counter()
            chunks.append(chunk)
        return stream, chunks, first_yield


def _held_until(chunks: list[cs.AudioChunk], threshold_ms: float) -> cs.AudioChunk:
    """The first chunk with which the audio received reaches ``threshold_ms`` (or the last one)."""
    for chunk in chunks:
        if chunk.last or 1000 * (chunk.sample - chunks[0].sample) / 24_000 + 20 >= threshold_ms:
            return chunk
    raise AssertionError("no last chunk")


async def test_the_advice_covers_a_stream_slower_than_real_time_and_the_client_holds_it(
    make_app: MakeApp, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="server.core.warmup")
    app: App = await make_app("--cache-bytes", "0")
    await app.warmed_up.wait()
    # The warm-up calibrated the pace: the start-up line says what to expect, hello carries it.
    assert any("expected RTF" in r.getMessage() and "fake" in r.getMessage() for r in caplog.records)
    ws, hello = await open_client(app.port)
    await ws.close()
    assert hello["expected_rtf"] < 1 and hello["buffer_ms_per_s"] == 0  # the fake engine's 2 ms steps

    fake_engine(app).step_base_s = SLOW_STEP_S  # now slower than real time
    await _speak(app.port, MEASURE, 0)  # its steps are the window the next advice reads
    stream, chunks, first_yield = await _speak(app.port, ADVISED, 0)

    assert stream.expected_rtf is not None and stream.expected_rtf >= NOMINAL_RTF
    assert stream.buffer_ms_per_s is not None and stream.buffer_ms_per_s > 0
    audio_s = sum(len(c.data) for c in chunks) / 2 / 24_000
    block_s = 16 * SAMPLES_PER_TOKEN / 24_000
    # At least what the nominal pace needs for the real length (the RTF is measured slower, and
    # the length foreseen longer), and never more than the stream.
    least = (audio_s - block_s) * (1 - 1 / NOMINAL_RTF) + block_s
    assert stream.buffer_ms is not None and 1000 * least <= stream.buffer_ms
    # The client held the audio until that much had arrived.
    assert _held_until(chunks, stream.buffer_ms).received_at <= first_yield
    # On 300 ms a listener stalls: the audio can only arrive later than the nominal pace, never
    # earlier, so this holds however loaded the machine is. (That the advice itself plays through
    # is the bound above, on the nominal pace: asserting zero stalls on these wall-clock arrivals
    # would make the test depend on the machine's load, so bench/results shows that part.)
    arrivals = [(c.received_at - chunks[0].received_at, len(c.data) / 2 / 24_000) for c in chunks]
    assert simulate(arrivals, 0.3).underruns > 0


async def test_without_advice_the_client_holds_its_own_buffer(make_app: MakeApp) -> None:
    app: App = await make_app("--no-warmup", "--cache-bytes", "0")
    ws, hello = await open_client(app.port)
    await ws.close()
    assert "buffer_ms" not in hello  # nothing measured yet: v1's hello
    fake_engine(app).step_base_s = 0.05
    stream, chunks, first_yield = await _speak(app.port, ADVISED, 300)
    assert stream.buffer_ms is None and stream.expected_rtf is None  # the first stream: no advice
    assert _held_until(chunks, 300).received_at <= first_yield
    assert not chunks[0].last  # the stream is longer than 300 ms: holding it meant something


async def test_the_advice_counts_the_streams_this_front_end_is_generating(make_app: MakeApp) -> None:
    # A burst of starts reaches the front end before the engine core's gauges count it: each
    # advice is given the streams generating here (the new one among them), and hello one more.
    app: App = await make_app("--cache-bytes", "0")
    await app.warmed_up.wait()
    pace = app.service.pace
    given: list[int] = []
    real_advice = pace.advice

    def spy(*args: object, open_streams: int = 0, **kwargs: object) -> object:
        given.append(open_streams)
        return real_advice(*args, open_streams=open_streams, **kwargs)  # type: ignore[arg-type]

    pace.advice = spy  # type: ignore[method-assign]
    fake_engine(app).step_base_s = 0.2  # long enough that no stream ends during the test
    ws, _ = await open_client(app.port)
    try:
        for k in range(3):
            await start(ws, id=f"s{k}", text="A sentence long enough to still be speaking. " * 4)
            while not _is_started(await recv(ws)):  # frames of the streams before it, skipped
                pass
        other, _ = await open_client(app.port)
        await other.close()
    finally:
        await ws.close()
    assert given == [0, 1, 2, 3, 3], given  # hello, three starts (each counting itself), a second hello


def _is_started(message: str | bytes) -> bool:
    return isinstance(message, str) and json.loads(message).get("type") == "started"
