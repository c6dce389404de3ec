"""ElevenLabs' own clients pointed at our server by their URL option: pipecat's and LiveKit's.

Each is the framework's unchanged service (pipecat's ``ElevenLabsTTSService`` and
``ElevenLabsHttpTTSService``, ``livekit-plugins-elevenlabs``'s ``TTS``) with only its base URL
set to ours (and our voice id); the audio must equal our own WebSocket stream of the same
request (voice and seed: ``--elevenlabs-seed``), and the word timings must be ours.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT
from livekit.plugins import elevenlabs as lk_elevenlabs
from pipecat.frames.frames import InterruptionFrame, TTSAudioRawFrame, TTSTextFrame
from pipecat.services.elevenlabs.tts import ElevenLabsHttpTTSService, ElevenLabsTTSService
from pipecat.tests.utils import SleepFrame, run_test

from tests.integration.conftest import fake_engine, wait_until
from tests.integration.test_incremental import ANSWER
from tests.integration.test_pipecat import llm_answer
from tests.integration.timed_words import our_words, ours, pipecat_words, same_times

SEED = "9"
#: pipecat's sentence aggregator and LiveKit's sentence tokenizer cut this as our segmenter does.
LK_TEXT = "The first sentence is right here. The second sentence ends it all."


async def test_pipecat_elevenlabs_websocket_service_speaks_our_stream_with_its_words(make_app: Any) -> None:
    app = await make_app("--elevenlabs-seed", SEED)
    tts = ElevenLabsTTSService(
        api_key="unused",
        url=f"ws://127.0.0.1:{app.http_port}",  # the one option changed: the base URL
        settings=ElevenLabsTTSService.Settings(voice="default"),
        sample_rate=24_000,
    )
    down, _ = await run_test(tts, frames_to_send=[*llm_answer(ANSWER), SleepFrame(1.5)])
    reference = await ours(app, ANSWER)
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    assert b"".join(f.audio for f in audio) == reference.payload
    assert {(f.sample_rate, f.num_channels) for f in audio} == {(24_000, 1)}
    # pipecat times each word by the alignment it read: ours, on its clock.
    same_times(pipecat_words(down), our_words(reference), offset=True)


async def test_pipecat_elevenlabs_http_service_speaks_our_streams_with_their_words(make_app: Any) -> None:
    app = await make_app("--elevenlabs-seed", SEED)
    async with aiohttp.ClientSession() as session:
        tts = ElevenLabsHttpTTSService(
            api_key="unused",
            base_url=f"http://127.0.0.1:{app.http_port}",
            aiohttp_session=session,
            settings=ElevenLabsHttpTTSService.Settings(voice="default"),
            sample_rate=24_000,
        )
        down, _ = await run_test(tts, frames_to_send=[*llm_answer(ANSWER), SleepFrame(1.5)])
    # The HTTP service asks for one sentence per request: each is one stream of ours.
    sentences = ["Sentence one is here.", "第二句话在这里。", "The third sentence ends it all."]
    references = [await ours(app, s) for s in sentences]
    audio = b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame))
    assert audio == b"".join(r.payload for r in references)
    want: list[tuple[str, float]] = []
    clock = 0.0
    for r in references:  # pipecat adds each response's duration to its clock
        want += [(w, t + clock) for w, t in our_words(r)]
        assert r.done is not None
        clock += r.words[-1]["end"] / 24_000
    same_times(pipecat_words(down), want, offset=True)


async def test_pipecat_interruption_keeps_only_the_words_played(make_app: Any) -> None:
    # Slower than real time (one segment at a time, 16 tokens of 21 ms each per 500-ms step),
    # so that the interruption comes while the answer is still being made.
    flags = ("--fake-step-ms", "500", "--segment-lookahead", "0", "--cache-bytes", "0")
    app = await make_app("--elevenlabs-seed", SEED, *flags)
    engine = fake_engine(app)
    tts = ElevenLabsTTSService(
        api_key="unused",
        url=f"ws://127.0.0.1:{app.http_port}",
        settings=ElevenLabsTTSService.Settings(voice="default"),
        sample_rate=24_000,
    )
    numbers = ["one", "two", "three", "four", "five", "six", "seven", "eight"]
    long_answer = " ".join(f"This is sentence {n} of a long answer." for n in numbers)
    frames = [*llm_answer(long_answer), SleepFrame(5.0), InterruptionFrame(), SleepFrame(1.0)]
    down, _ = await run_test(tts, frames_to_send=frames)
    cut = next(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame))
    played = sum(len(f.audio) for f in down[:cut] if isinstance(f, TTSAudioRawFrame)) / 2 / 24_000
    kept = [f for f in down[:cut] if isinstance(f, TTSTextFrame)]
    words = long_answer.replace(".", "").split()
    # What pipecat keeps (the TTSTextFrames that went downstream) are the first words of the
    # answer, each timed inside the audio that went out before the interruption, and none after it.
    assert 0 < len(kept) < len(words) and [f.text for f in kept] == words[: len(kept)]
    assert all(not isinstance(f, TTSTextFrame) for f in down[cut:])
    first = kept[0].pts
    assert first is not None and all(f.pts is not None and (f.pts - first) / 1e9 < played for f in kept)
    # The interruption closed the context without a flush: its generation was cancelled.
    await wait_until(lambda: engine.live_sequences == 0 and any(k == "drop" for k, _ in list(engine.events)))
    await wait_until(lambda: 'chattts_streams_total{reason="cancelled"} 1.0' in app.metrics.render().decode())


async def test_livekit_elevenlabs_plugin_streams_and_synthesizes_our_audio_with_timed_words(
    make_app: Any,
) -> None:
    app = await make_app("--elevenlabs-seed", SEED)
    reference = await ours(app, LK_TEXT)
    async with aiohttp.ClientSession() as session:
        tts = lk_elevenlabs.TTS(
            api_key="unused",
            base_url=f"http://127.0.0.1:{app.http_port}/v1",  # the one option changed
            voice_id="default",
            encoding="pcm_24000",
            http_session=session,
        )
        stream = tts.stream()
        stream.push_text(LK_TEXT)
        stream.end_input()
        audio, timed = bytearray(), []
        async with asyncio.timeout(30):
            async for event in stream:
                audio += event.frame.data.tobytes()
                timed += event.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])
        chunked = bytearray()
        async with asyncio.timeout(30):
            async for event in tts.synthesize(LK_TEXT):
                chunked += event.frame.data.tobytes()
        await tts.aclose()
    assert bytes(audio) == reference.payload
    # LiveKit reads normalizedAlignment as times from the context's start.
    same_times([(str(t).strip(), float(t.start_time)) for t in timed], our_words(reference), offset=False)
    # REST: LiveKit ends its frames with up to one 10-ms frame of silence.
    padding = chunked[len(reference.payload) :]
    assert chunked.startswith(reference.payload) and len(padding) <= 480 and not any(padding)
