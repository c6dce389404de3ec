"""The pipecat TTS service (client_py's ``pipecat`` extra) in a pipeline run by pipecat's ``run_test``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pipecat.frames.frames import (
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSTextFrame,
)
from pipecat.tests.utils import SleepFrame, run_test

from chattts_stream_client.pipecat import ChatTTSStreamTTSService
from server.app import App
from server.engine.fake import FakeEngine
from tests.integration.test_incremental import ANSWER, llm_tokens
from tests.integration.timed_words import our_words, ours, pipecat_words, same_times
from tests.wsclient import stream_payload


def url(app: App) -> str:
    return f"ws://127.0.0.1:{app.port}/v1/stream"


async def ws_pcm(app: App, text: str, seed: int) -> bytes:
    return await stream_payload(app.port, text=text, seed=seed, voice="default")


def llm_answer(text: str) -> list[Any]:
    return [
        LLMFullResponseStartFrame(),
        *(LLMTextFrame(t) for t in llm_tokens(text)),
        LLMFullResponseEndFrame(),
    ]


async def test_text_frames_in_audio_frames_out_equal_the_websocket_stream(app: App) -> None:
    tts = ChatTTSStreamTTSService(url=url(app), seed=9)
    requests: list[str] = []

    @tts.event_handler("on_tts_request")
    async def on_request(service: Any, context_id: str, text: str) -> None:
        requests.append(text)

    down, _ = await run_test(tts, frames_to_send=[*llm_answer(ANSWER), SleepFrame(1.0)])
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    assert audio and {(f.sample_rate, f.num_channels) for f in audio} == {(24_000, 1)}
    # pipecat hands over the LLM's tokens as they come; the turn is one incremental stream of the
    # server, which gives the same bytes as the whole answer in one WebSocket stream.
    assert "".join(requests) == ANSWER and len(requests) == len(llm_tokens(ANSWER))
    assert len({f.context_id for f in audio}) == 1
    assert b"".join(f.audio for f in audio) == await ws_pcm(app, ANSWER, 9)
    metrics = app.metrics.render().decode()
    assert 'chattts_streams_total{reason="complete"} 2.0' in metrics  # the turn's and the reference


async def test_interruption_cancels_generation_on_the_server(make_app: Any) -> None:
    app = await make_app("--fake-step-ms", "100", "--cache-bytes", "0")
    engine = app.engine_client.engine
    assert isinstance(engine, FakeEngine)
    tts = ChatTTSStreamTTSService(url=url(app), seed=3)
    long_sentence = "This one long sentence keeps the engine busy for many blocks, " * 12 + "and then ends."
    dropped_at: list[float] = []

    async def watch() -> None:  # when the engine dropped the row (a cancel, not an end)
        while not dropped_at:
            if any(kind == "drop" for kind, _ in list(engine.events)):
                dropped_at.append(time.monotonic())
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    try:
        # The long sentence takes ~10 s of 100-ms steps: the interruption at 1.5 s comes mid-stream
        # even on a loaded machine, and 3 s after it leave room to see the row freed before the end.
        frames = [*llm_answer(long_sentence), SleepFrame(1.5), InterruptionFrame(), SleepFrame(3.0)]
        down, _ = await run_test(tts, frames_to_send=frames)
        ended_at = time.monotonic()  # the EndFrame (which closes the client) came 3 s after the interruption
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    audio = b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame))
    assert audio  # it was speaking when interrupted
    assert dropped_at and dropped_at[0] < ended_at - 1.5  # freed by the interruption, not by the shutdown
    assert engine.live_sequences == 0
    full = await ws_pcm(app, long_sentence, 3)
    assert len(audio) < len(full) and full.startswith(audio)  # a prefix of the stream: cut short
    assert 'chattts_streams_total{reason="cancelled"} 1.0' in app.metrics.render().decode()


async def test_each_turn_and_each_speak_frame_is_one_stream(app: App) -> None:
    tts = ChatTTSStreamTTSService(url=url(app), seed=4)
    second = "第二个回答。It has two sentences."
    frames = [*llm_answer(ANSWER), SleepFrame(0.5), *llm_answer(second), SleepFrame(0.5)]
    frames += [TTSSpeakFrame("Spoken as it is."), SleepFrame(1.0)]
    down, _ = await run_test(tts, frames_to_send=frames)
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    turns: dict[str, bytes] = {}
    for f in audio:
        turns[f.context_id or ""] = turns.get(f.context_id or "", b"") + f.audio
    assert list(turns.values()) == [
        await ws_pcm(app, ANSWER, 4),
        await ws_pcm(app, second, 4),
        await ws_pcm(app, "Spoken as it is.", 4),
    ]
    # One stream per turn (and per speak frame), each ended by the turn's end: 3 + the 3 references.
    assert 'chattts_streams_total{reason="complete"} 6.0' in app.metrics.render().decode()


async def test_each_word_is_timed_by_the_server_and_an_interruption_keeps_the_first_ones(
    make_app: Any,
) -> None:
    app = await make_app()
    tts = ChatTTSStreamTTSService(url=url(app), seed=9)
    down, _ = await run_test(tts, frames_to_send=[*llm_answer(ANSWER), SleepFrame(1.0)])
    # The turn's text frames are the server's words, at the server's times (pipecat's pts clock).
    same_times(pipecat_words(down), our_words(await ours(app, ANSWER)), offset=True)
    # Slower than real time: the interruption comes mid-answer; the words kept are the first ones,
    # each inside the audio that went out before it.
    slow = await make_app("--fake-step-ms", "500", "--segment-lookahead", "0", "--cache-bytes", "0")
    tts = ChatTTSStreamTTSService(url=url(slow), seed=9)
    answer = " ".join(f"This is sentence {n} of a long answer." for n in ["one", "two", "three", "four"])
    frames = [*llm_answer(answer), SleepFrame(5.0), InterruptionFrame(), SleepFrame(1.0)]
    down, _ = await run_test(tts, frames_to_send=frames)
    cut = next(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame))
    played = sum(len(f.audio) for f in down[:cut] if isinstance(f, TTSAudioRawFrame)) / 2 / 24_000
    kept = [f for f in down[:cut] if isinstance(f, TTSTextFrame)]
    words = answer.replace(".", "").split()
    assert 0 < len(kept) < len(words) and [f.text for f in kept] == words[: len(kept)]
    assert all(not isinstance(f, TTSTextFrame) for f in down[cut:])
    assert all(f.pts is not None and kept[0].pts is not None for f in kept)
    assert all((f.pts - kept[0].pts) / 1e9 < played for f in kept if f.pts and kept[0].pts)
